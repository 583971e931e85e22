//! DDP / FSDP on CPU thread ranks: the same adapter as one rank with the same global batch,
//! FSDP's resident memory, the collectives' numbers, and a dead rank ending the run.

use crate::common::Session;
use crate::common::*;
use candle_core::{DType, Device, Tensor};
use lora_train::parallel::cpu::CpuGroup;
use lora_train::parallel::launch;
use lora_train::parallel::posted::{Left, Posted};
use lora_train::parallel::Group;
use lora_train::train::shards::resident_base_bytes;
use lora_train::train::Comm;
use lora_train::train::EnvRank;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Trains a golden case's model (llama_gqa: 8 rows of uneven length) from its init adapter
/// for 3 steps (or the last `train.max_steps` of `sets`); returns the adapter.
fn adapter_of(case: &str, sets: &[&str], parallel: &str) -> HashMap<String, Tensor> {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let text = format!("{}\n{parallel}\n", golden_recipe(case, &out));
    let mut all = vec![
        "train.max_grad_norm=1.0",
        "lora.dropout=0.0",
        "train.max_steps=3",
    ];
    all.extend_from_slice(sets);
    let steps = all
        .iter()
        .rev()
        .find_map(|s| s.strip_prefix("train.max_steps="))
        .map(|n| n.parse::<usize>().unwrap());
    let r = recipe(tmp.path(), &text, &all);
    let summary = lora_train::run::run(r).unwrap();
    assert_eq!(Some(summary.steps), steps);
    load_st(&out.join("adapter_model.safetensors"))
}

fn par(strategy: &str, world: usize) -> String {
    let devs: Vec<String> = (0..world).map(|d| d.to_string()).collect();
    format!(
        "[parallel]\nstrategy = \"{strategy}\"\ndevices = [{}]\ntimeout_s = 60\n",
        devs.join(", ")
    )
}

fn assert_same(
    what: &str,
    got: &HashMap<String, Tensor>,
    want: &HashMap<String, Tensor>,
    rtol: f64,
    atol: f64,
) {
    let mut k1: Vec<_> = got.keys().collect();
    let mut k2: Vec<_> = want.keys().collect();
    k1.sort();
    k2.sort();
    assert_eq!(k1, k2, "{what}: adapter keys");
    assert!(k1.len() >= 4, "{what}: {} keys", k1.len());
    for (k, t) in want {
        assert_close(&format!("{what} {k}"), &got[k], t, rtol, atol);
    }
}

/// `world` ranks × `micro` rows × `accum` micro-batches against one rank with the same global
/// batch, two ways:
/// - one rank × `micro` rows × world·accum micro-batches runs every row at the same padded
///   length, so only the order of the gradient sum differs: rtol 1e-5 plus 1e-6 of the
///   largest entry (bit-identical when accum = 1, as observed; ~5e-7 with 8 terms summed in
///   another order);
/// - one rank × world·micro rows × `accum` pads rows to other lengths, which moves f32 sums
///   by ~4e-6 of the largest entry after three AdamW steps whether or not ranks are involved
///   (the same noise as accumulation vs a big batch on one rank): rtol 1e-5 plus 1e-5 of the
///   tensor's largest entry.
fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn check(case: &str, strategy: &str, world: usize, micro: usize, accum: usize, extra: &[&str]) {
    let set = |m: usize, a: usize| {
        let mut v = vec![
            format!("train.micro_batch={m}"),
            format!("train.grad_accum={a}"),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let (d, sa, sb) = (
        set(micro, accum),
        set(micro, world * accum),
        set(world * micro, accum),
    );
    let dist = adapter_of(case, &refs(&d), &par(strategy, world));
    let what = format!("{case} {strategy} {world}x{micro}x{accum}");
    let same_rows = adapter_of(case, &refs(&sa), "");
    assert_same(
        &format!("{what} vs 1x{micro}x{}", world * accum),
        &dist,
        &same_rows,
        1e-5,
        1e-6,
    );
    let big = adapter_of(case, &refs(&sb), "");
    assert_same(
        &format!("{what} vs 1x{}x{accum}", world * micro),
        &dist,
        &big,
        1e-5,
        1e-5,
    );
    // The adapter moved: the comparison is not between two untouched inits.
    let init = load_st(&golden_dir(case).join("init_adapter/adapter_model.safetensors"));
    let moved = big
        .iter()
        .map(|(k, t)| max_abs_diff(t, &init[k]))
        .fold(0f32, f32::max);
    assert!(moved > 1e-4, "{what}: adapter did not train: {moved}");
}

#[test]
fn ddp_two_ranks_of_one_row_equal_one_rank_of_two() {
    check("llama_gqa", "ddp", 2, 1, 1, &[]);
}

#[test]
fn ddp_with_accumulation_and_uneven_rows_equals_one_rank() {
    // 4 rows per step, rows of 9, 11, 3, 7, ... counted tokens: each rank's share differs.
    check("llama_gqa", "ddp", 2, 1, 2, &[]);
}

#[test]
fn fsdp_equals_one_rank_with_and_without_checkpointing() {
    check("llama_gqa", "fsdp", 2, 1, 1, &[]);
    check(
        "llama_gqa",
        "fsdp",
        2,
        1,
        1,
        &["train.activation_checkpointing=true"],
    );
}

#[test]
fn fsdp_four_ranks_with_accumulation_equal_one_rank() {
    // Four ranks: the layers' flat sizes are not multiples of 4, so shards are padded.
    check(
        "llama_gqa",
        "fsdp",
        4,
        1,
        2,
        &["train.activation_checkpointing=true"],
    );
}

#[test]
fn fsdp_with_biases_and_a_tied_head_equals_one_rank() {
    // Qwen2's q/k/v biases ride in the layer's flat buffer; a tied head is the gathered
    // embedding itself.
    for case in ["qwen2_bias", "llama_mha_tied_rope3"] {
        check(
            case,
            "fsdp",
            2,
            1,
            1,
            &["train.activation_checkpointing=true"],
        );
    }
}

/// `model.path=` the qlora case's bitsandbytes 4-bit checkpoint (double quant, one layer).
fn bnb4() -> String {
    let dir = golden_dir("qlora_llama_gqa").join("model_bnb4");
    format!("model.path={}", dir.display())
}

#[test]
fn fsdp_over_nf4_equals_one_rank_quantized_at_load() {
    // Two layers quantized as they load (double quant), gathered in NF4 one layer ahead;
    // three ranks pad every buffer (f32 and u8 codes) unevenly, for 2 steps (6 of the 8 rows:
    // a step that crosses the epoch takes other rows on 3 ranks than on one, NF4 or not).
    check("llama_gqa", "fsdp", 2, 1, 1, &["model.quantize=nf4"]);
    let three = ["model.quantize=nf4", "train.max_steps=2"];
    check("llama_gqa", "fsdp", 3, 1, 1, &three);
    let ckpt = [three.as_slice(), &["train.activation_checkpointing=true"]].concat();
    check("llama_gqa", "fsdp", 3, 1, 1, &ckpt);
}

#[test]
fn fsdp_over_a_bnb_4bit_checkpoint_equals_one_rank() {
    let path = bnb4();
    check("qlora_llama_gqa", "fsdp", 2, 1, 2, &[&path]);
    let three = [
        &path,
        "train.max_steps=2",
        "train.activation_checkpointing=true",
    ];
    check("qlora_llama_gqa", "fsdp", 3, 1, 1, &three);
}

/// Rank 0 saves step 2 of 4 of a DDP run; a second run continues from it as FSDP (the same
/// numbers) and must end on the same adapter to the bit, every rank having restored the state.
/// `sets`: more settings of both runs.
fn resumed_as_fsdp_ends_where_unbroken(sets: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let mut sets = sets.to_vec();
    sets.extend([
        "train.micro_batch=1",
        "train.max_steps=4",
        "output.save_every=2",
    ]);
    let run = |out: &std::path::Path, strategy: &str, extra: &[&str]| {
        let text = format!("{}\n{}", golden_recipe("llama_gqa", out), par(strategy, 2));
        let mut all = sets.clone();
        all.extend_from_slice(extra);
        let dir = tempfile::tempdir().unwrap();
        lora_train::run::run(recipe(dir.path(), &text, &all)).unwrap()
    };
    let whole = run(&a, "ddp", &[]);
    assert_eq!(whole.steps, 4);
    let from = format!(
        "train.resume={:?}",
        a.join("checkpoint-2").display().to_string()
    );
    let rest = run(&b, "fsdp", &[&from]);
    assert_eq!(rest.steps, 4);
    assert_eq!(rest.losses.len(), 2);
    assert_eq!(rest.losses[..], whole.losses[2..]);
    let (x, y) = (
        load_st(&a.join("adapter_model.safetensors")),
        load_st(&b.join("adapter_model.safetensors")),
    );
    assert_same("resumed vs unbroken", &y, &x, 0.0, 0.0);
}

#[test]
fn a_ddp_run_resumed_from_its_checkpoint_ends_where_an_unbroken_one_does() {
    resumed_as_fsdp_ends_where_unbroken(&[]);
}

#[test]
fn an_nf4_run_resumed_as_fsdp_ends_where_an_unbroken_one_does() {
    resumed_as_fsdp_ends_where_unbroken(&["model.quantize=nf4"]);
}

/// A DDP run on the tiny golden model whose rank 1 fails (or hangs, when `hang`) right after
/// loading, while rank 0 trains: (the run's error, seconds to it, whether rank 0 wrote).
fn run_with_a_bad_rank(hang: bool) -> (String, f64, bool) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let text = format!(
        "{}\n[parallel]\nstrategy = \"ddp\"\ndevices = [0, 1]\ntimeout_s = 1\n",
        golden_recipe("llama_gqa", &out)
    );
    let r = recipe(tmp.path(), &text, &["train.micro_batch=1"]);
    let start = Instant::now();
    let out2 = out.clone();
    let body = move |rank: usize, comm: Box<dyn Comm>| -> anyhow::Result<usize> {
        let s = Session::for_rank(r.clone(), comm, 0)?;
        if rank == 1 {
            if hang {
                std::thread::sleep(Duration::from_secs(30));
            }
            anyhow::bail!(anyhow::anyhow!("train.jsonl:5: bad row").context("rank 1's data"));
        }
        Ok(s.train(&out2)?.steps)
    };
    let err = launch::threads(group(2, 1), Arc::new(body), Duration::from_secs(1)).unwrap_err();
    let wrote = out.join("adapter_model.safetensors").exists();
    (format!("{err:#}"), start.elapsed().as_secs_f64(), wrote)
}

#[test]
fn a_training_rank_that_fails_ends_the_run_with_its_error() {
    let (err, secs, wrote) = run_with_a_bad_rank(false);
    assert_eq!(
        err,
        "rank 1 of 2 failed: rank 1's data: train.jsonl:5: bad row"
    );
    assert!(secs < 10.0, "{secs} s");
    assert!(!wrote, "rank 0 wrote an adapter of a failed run");
}

#[test]
fn a_training_rank_that_hangs_times_out_the_run() {
    let (err, secs, wrote) = run_with_a_bad_rank(true);
    assert!(
        err.starts_with("rank 0 of 2 failed: ")
            && err.contains("rank 0 waited 1 s in all_reduce for rank(s) [1], which never joined"),
        "{err}"
    );
    assert!(secs < 10.0, "{secs} s");
    assert!(!wrote);
}

/// (resident frozen bytes, largest gathered group) of each rank of an FSDP session.
fn fsdp_resident(world: usize) -> Vec<(usize, usize)> {
    let tmp = tempfile::tempdir().unwrap();
    let text = format!(
        "{}\n{}",
        golden_recipe("llama_gqa", &tmp.path().join("out")),
        par("fsdp", world)
    );
    let r = recipe(tmp.path(), &text, &[]);
    let group = CpuGroup::new(world, Duration::from_secs(60));
    let body = move |rank: usize, comm: Box<dyn Comm>| {
        let s = Session::for_rank(r.clone(), comm, 0)?;
        let shards = s.shards.as_ref().unwrap();
        let me = (
            resident_base_bytes(&s.model, Some(shards)),
            shards.largest_group_bytes(),
        );
        // Gather everything every rank holds (rank order) to return it from rank 0.
        let t = Tensor::new(&[me.0 as f64, me.1 as f64], &Device::Cpu)?;
        let all = s.comm.all_gather(&t)?.to_vec1::<f64>()?;
        let _ = rank;
        Ok(all
            .chunks(2)
            .map(|c| (c[0] as usize, c[1] as usize))
            .collect::<Vec<_>>())
    };
    launch::threads(group, Arc::new(body), Duration::from_secs(5)).unwrap()
}

#[test]
fn fsdp_ranks_hold_one_nth_of_the_base() {
    let tmp = tempfile::tempdir().unwrap();
    let r = recipe(
        tmp.path(),
        &golden_recipe("llama_gqa", &tmp.path().join("out")),
        &[],
    );
    let s = Session::new(r).unwrap();
    let full = resident_base_bytes(&s.model, None);
    let layer: usize = s.model.layers[0]
        .clone()
        .frozen_mut()
        .iter()
        .map(|t| t.elem_count() * 4)
        .sum();
    assert!(full > 10_000, "{full}");
    for world in [2, 3] {
        let ranks = fsdp_resident(world);
        assert_eq!(ranks.len(), world);
        // Groups: one per layer + embedding/head; each is padded by < world elements and
        // leaves one 1-element placeholder per frozen tensor.
        let groups = s.model.layers.len() + 1;
        let slack = groups * world * 4 + s.model.base_tensors().len() * 4;
        for (rank, &(bytes, largest)) in ranks.iter().enumerate() {
            assert!(
                bytes >= full / world && bytes <= full / world + slack,
                "world {world} rank {rank}: {bytes} resident bytes, full {full}, 1/N {}",
                full / world
            );
            // What a gather adds on top: the largest group, at least a whole layer.
            assert!(
                largest >= layer && largest < full,
                "{largest} vs layer {layer}"
            );
        }
    }
}

/// What each rank of an FSDP session over an NF4 base holds: (resident frozen bytes, bytes
/// of its u8 shards (the layers' NF4 codes), the NF4 bytes it reports) per rank, and layer 0
/// gathered and dequantized on rank 0: each linear's W.
type Nf4Ranks = (Vec<(usize, usize, usize)>, Vec<Tensor>);

fn fsdp_nf4_ranks(case: &str, world: usize, sets: &[&str]) -> Nf4Ranks {
    let tmp = tempfile::tempdir().unwrap();
    let text = format!(
        "{}\n{}",
        golden_recipe(case, &tmp.path().join("out")),
        par("fsdp", world)
    );
    let r = recipe(tmp.path(), &text, sets);
    let body = move |_rank: usize, comm: Box<dyn Comm>| {
        let s = Session::for_rank(r.clone(), comm, 0)?;
        let Some(shards) = s.shards.as_ref() else {
            anyhow::bail!("an FSDP session without shards");
        };
        let codes: usize = (shards.layers.iter().flat_map(|f| f.shards()))
            .filter(|t| t.dtype() == DType::U8)
            .map(|t| t.elem_count())
            .sum();
        let resident = resident_base_bytes(&s.model, Some(shards));
        let me = [resident, codes, shards.nf4_bytes].map(|x| x as f64);
        let t = Tensor::new(&me, &Device::Cpu)?;
        let all = s.comm.all_gather(&t)?.to_vec1::<f64>()?;
        let layer = shards.layer(&s.model, 0, &*s.comm, false)?;
        let ws = layer
            .resident()?
            .linears()
            .iter()
            .map(|l| l.w.clone())
            .collect();
        let ranks = (all.chunks(3)).map(|c| (c[0] as usize, c[1] as usize, c[2] as usize));
        Ok((ranks.collect::<Vec<_>>(), ws))
    };
    let group = CpuGroup::new(world, Duration::from_secs(60));
    launch::threads(group, Arc::new(body), Duration::from_secs(5)).unwrap()
}

/// FSDP over NF4: each rank keeps 1/N of the base as one rank holds it in NF4 (codes, absmax,
/// norms, head), plus padding, alignment gaps and placeholders; its u8 shards are 1/N of the
/// codes; and a layer gathered in NF4 dequantizes to one rank's weights bit for bit.
#[test]
fn fsdp_ranks_hold_one_nth_of_an_nf4_base() {
    let bnb = bnb4();
    for (case, sets, worlds) in [
        ("llama_gqa", vec!["model.quantize=nf4"], vec![2, 3]),
        ("qlora_llama_gqa", vec![bnb.as_str()], vec![3]),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let one = golden_recipe(case, &tmp.path().join("out"));
        let s = Session::new(recipe(tmp.path(), &one, &sets)).unwrap();
        let full = resident_base_bytes(&s.model, None);
        let lins: Vec<_> = s.model.layers.iter().flat_map(|l| l.linears()).collect();
        let arrays: Vec<&Tensor> = lins
            .iter()
            .flat_map(|l| l.q.as_ref().map(|q| q.arrays()).unwrap_or_default())
            .collect();
        let u8s: Vec<_> = arrays.iter().filter(|t| t.dtype() == DType::U8).collect();
        let codes: usize = u8s.iter().map(|t| t.elem_count()).sum();
        let nf4: usize = s.model.layers.iter().map(|l| l.nf4_bytes()).sum();
        assert!(lins.iter().all(|l| l.q.is_some()), "{case}: not all in NF4");
        // The NF4 linears are most of the base; the head and norms the rest.
        assert!(
            nf4 > full / 4 && nf4 < full,
            "{case}: {nf4} of {full} in NF4"
        );
        let want: Vec<Tensor> = s.model.layers[0]
            .resident()
            .unwrap()
            .linears()
            .iter()
            .map(|l| l.w.clone())
            .collect();
        for world in worlds {
            let (ranks, ws) = fsdp_nf4_ranks(case, world, &sets);
            let what = format!("{case} world {world}");
            assert_eq!(ranks.len(), world);
            // Per buffer (2 a layer: f32 and u8, 1 for the io group) < world elements of
            // padding; per u8 array < 16 bytes of alignment; per tensor a placeholder.
            let groups = s.model.layers.len() + 1;
            let slack = 2 * groups * world * 4 + u8s.len() * 16 + s.model.base_tensors().len() * 4;
            for (rank, &(bytes, u8_bytes, reported)) in ranks.iter().enumerate() {
                assert_eq!(reported, nf4, "{what} rank {rank}: the NF4 bytes reported");
                assert!(
                    bytes >= full / world && bytes <= full / world + slack,
                    "{what} rank {rank}: {bytes} resident bytes, full {full}, 1/N {}",
                    full / world
                );
                let hi = codes + u8s.len() * 16 + s.model.layers.len() * world;
                assert!(
                    u8_bytes * world >= codes && u8_bytes * world <= hi,
                    "{what} rank {rank}: {u8_bytes} code bytes × {world}, all {codes}"
                );
            }
            assert_eq!(ws.len(), want.len());
            for (got, want) in ws.iter().zip(&want) {
                assert_eq!(got.dims(), want.dims(), "{what}");
                assert_eq!(max_abs_diff(got, want), 0.0, "{what}: a gathered W differs");
            }
        }
    }
}

fn group(world: usize, secs: u64) -> Arc<CpuGroup> {
    CpuGroup::new(world, Duration::from_secs(secs))
}

#[test]
fn cpu_collectives_give_exact_sums_gathers_and_broadcasts() {
    let body = |rank: usize, comm: Box<dyn Comm>| {
        let x = Tensor::new(&[rank as f32 + 1.0, 10.0 * rank as f32], &Device::Cpu)?;
        let sum = comm.all_reduce_sum(&x)?.to_vec1::<f32>()?;
        let all = comm.all_gather(&x)?.to_vec1::<f32>()?;
        let b = comm.broadcast(&x, 2)?.to_vec1::<f32>()?;
        comm.barrier()?;
        Ok((rank, comm.world(), sum, all, b))
    };
    let (rank, world, sum, all, b) =
        launch::threads(group(3, 10), Arc::new(body), Duration::from_secs(5)).unwrap();
    assert_eq!((rank, world), (0, 3));
    assert_eq!(sum, vec![6.0, 30.0]);
    assert_eq!(all, vec![1.0, 0.0, 2.0, 10.0, 3.0, 20.0]);
    assert_eq!(b, vec![3.0, 20.0]);
}

#[test]
fn a_failing_rank_stops_the_others_with_its_error() {
    let start = Instant::now();
    let body = |rank: usize, comm: Box<dyn Comm>| -> anyhow::Result<()> {
        let x = Tensor::new(&[1f32], &Device::Cpu)?;
        for i in 0..1_000_000 {
            if rank == 1 && i == 3 {
                anyhow::bail!(anyhow::anyhow!("row 17 is malformed").context("data of rank 1"));
            }
            comm.all_reduce_sum(&x)?;
        }
        Ok(())
    };
    let err = launch::threads(group(3, 600), Arc::new(body), Duration::from_secs(600)).unwrap_err();
    let msg = format!("{err:#}");
    assert_eq!(
        msg,
        "rank 1 of 3 failed: data of rank 1: row 17 is malformed"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_rank_that_stops_participating_times_out_the_run() {
    let start = Instant::now();
    let body = |rank: usize, comm: Box<dyn Comm>| -> anyhow::Result<()> {
        let x = Tensor::new(&[1f32], &Device::Cpu)?;
        comm.all_reduce_sum(&x)?;
        if rank == 1 {
            // Hangs outside any collective (a stuck data loader, say).
            std::thread::sleep(Duration::from_secs(30));
        }
        comm.all_reduce_sum(&x)?;
        Ok(())
    };
    let err = launch::threads(group(2, 1), Arc::new(body), Duration::from_secs(1)).unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.starts_with("rank 0 of 2 failed: rank 0 waited 1 s in all_reduce for rank(s) [1], which never joined"),
        "{msg}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn launcher_environment_torchrun_and_slurm() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    let torchrun = env(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ]);
    assert_eq!(
        EnvRank::from_env(&torchrun).unwrap(),
        Some(EnvRank {
            rank: 3,
            world: 4,
            local: 1,
            addr: "node0".into(),
            port: 29501
        })
    );
    let slurm = env(&[
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "2"),
        ("MASTER_ADDR", "n1"),
        ("MASTER_PORT", "1000"),
        ("LORA_TRAIN_PORT", "7000"),
    ]);
    let e = EnvRank::from_env(&slurm).unwrap().unwrap();
    assert_eq!((e.rank, e.world, e.local, e.port), (2, 8, 2, 7000));
    assert_eq!(EnvRank::from_env(&env(&[])).unwrap(), None);
    assert_eq!(
        EnvRank::from_env(&env(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap(),
        None
    );
    let err = EnvRank::from_env(&env(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "WORLD_SIZE = 2 (RANK = 0) but MASTER_ADDR is not set: export MASTER_ADDR=<rank 0's host>"
    );
    // Under Slurm the message names the variables read, and how an sbatch script sets them.
    let err = EnvRank::from_env(&env(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "4")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("SLURM_NTASKS = 4 (SLURM_PROCID = 1) but MASTER_ADDR is not set"),
        "{err}"
    );
    assert!(err.contains("scontrol show hostnames"), "{err}");
    assert!(!err.contains("WORLD_SIZE"), "{err}");
}

#[test]
fn rank_zero_shares_the_id_over_tcp() {
    // A free port: bind to 0, read it, release it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let id: Vec<u8> = (0..128u32).map(|i| (i * 7 % 251) as u8).collect();
    let t = Duration::from_secs(20);
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            let id = id.clone();
            std::thread::spawn(move || {
                let payload = (rank == 0).then_some(id.as_slice());
                launch::share(rank, 3, "127.0.0.1", port, payload, t).unwrap()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), id);
    }
}

#[test]
fn group_abort_reports_the_first_failure() {
    let g = group(2, 60);
    g.abort(1, "first");
    g.abort(0, "second");
    assert_eq!(g.failure(), Some((1, "first".to_string())));
    let comm = g.clone().comm(0).unwrap();
    let err = comm.barrier().unwrap_err().to_string();
    assert!(
        err.contains("rank 1 failed, so rank 0 stopped: first"),
        "{err}"
    );
}

/// Two GPUs (it fails on fewer; the GPU check runs it in `peercopy`): FSDP's gathers of static shards, which
/// ranks of one process copy from each other's memory (`share_static`, FSDP's under the
/// `peer_copy` experiment, and only under CUDA_MODULE_LOADING=EAGER), hold every rank's
/// shard in rank order, issued ahead or in line, bf16 and f32, and a tensor that was never
/// shared still goes through NCCL; sums and broadcasts (whose outputs are no longer zeroed
/// first) are exact.
#[cfg(feature = "nccl")]
#[test]
fn nccl_gathers_of_shared_shards_are_every_ranks_shard() {
    use lora_train::parallel::nccl::NcclGroup;
    need_gpus(2, "nccl_gathers_of_shared_shards_are_every_ranks_shard");
    // Rank r's shard g: small integers (exact in bf16), different for every rank and group.
    let shard = |r: usize, g: usize, dev: &Device| -> candle_core::Result<Tensor> {
        let n = 1000 + 7 * g; // sizes off any tile
        let v: Vec<f32> = (0..n)
            .map(|i| ((r * 37 + g * 11 + i) % 200) as f32)
            .collect();
        let dt = [DType::BF16, DType::F32][g % 2];
        Tensor::from_vec(v, n, dev)?.to_dtype(dt)
    };
    let body = move |rank: usize, comm: Box<dyn Comm>| -> anyhow::Result<usize> {
        let dev = Device::new_cuda(rank)?;
        let shards: Vec<Tensor> = (0..3)
            .map(|g| shard(rank, g, &dev))
            .collect::<Result<_, _>>()?;
        // Peer copies when the driver loads kernels eagerly (the GPU check runs this test so),
        // else a warning and NCCL gathers: the same values either way.
        let peer = comm.share_static(&shards.iter().collect::<Vec<_>>())?;
        let eager = std::env::var("CUDA_MODULE_LOADING").is_ok_and(|v| v == "EAGER");
        anyhow::ensure!(
            peer == eager,
            "rank {rank}: peer copies {peer}, eager loading {eager}"
        );
        let mut checked = 0;
        for (g, s) in shards.iter().enumerate() {
            let want: Vec<f32> = (0..2)
                .map(|r| {
                    shard(r, g, &Device::Cpu)?
                        .to_dtype(DType::F32)?
                        .to_vec1::<f32>()
                })
                .collect::<Result<Vec<_>, _>>()?
                .concat();
            let ahead = comm.all_gather_ahead(s)?;
            comm.gathered()?;
            let in_line = comm.all_gather(s)?;
            let fresh = comm.all_gather(&s.copy()?)?; // not shared: NCCL
            for got in [ahead, in_line, fresh] {
                let got = got.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                anyhow::ensure!(got == want, "rank {rank}, group {g}: a gather differs");
                checked += 1;
            }
        }
        let x = Tensor::new(&[rank as f32 + 1.0, 10.0 * rank as f32], &dev)?;
        let sum = comm.all_reduce_sum(&x)?.to_vec1::<f32>()?;
        let b = comm.broadcast(&x, 1)?.to_vec1::<f32>()?;
        anyhow::ensure!(
            sum == [3.0, 10.0] && b == [2.0, 10.0],
            "rank {rank}: {sum:?} {b:?}"
        );
        // A sum issued ahead, a gather behind it on the same stream: the gather may be used
        // after `gathered`, the sum after `reduced` (its input dropped meanwhile).
        let ahead = comm.all_reduce_sum_ahead(&(&x * 2.0)?)?;
        let gathered = comm.all_gather_ahead(&shards[0])?;
        comm.gathered()?;
        anyhow::ensure!(gathered.elem_count() == 2 * shards[0].elem_count());
        comm.reduced()?;
        let ahead = ahead.to_vec1::<f32>()?;
        anyhow::ensure!(ahead == [6.0, 20.0], "rank {rank}: sum ahead {ahead:?}");
        comm.barrier()?;
        Ok(checked)
    };
    // Peer copies are an experiment (FSDP asks for them only under LORA_TRAIN_EXPERIMENTS=
    // peer_copy; `share_static` is called here directly); this test, run with
    // CUDA_MODULE_LOADING=EAGER, is their GPU check.
    let group = NcclGroup::new(vec![0, 1], Duration::from_secs(30)).unwrap();
    let checked = launch::threads(group, Arc::new(body), Duration::from_secs(10)).unwrap();
    assert_eq!(checked, 9);
}

/// A value that records (its rank, the dropping thread) when dropped.
struct Tracked(
    usize,
    Arc<std::sync::Mutex<Vec<(usize, std::thread::ThreadId)>>>,
);

impl Drop for Tracked {
    fn drop(&mut self) {
        let me = std::thread::current().id();
        self.1.lock().unwrap().push((self.0, me));
    }
}

/// The table of NCCL's peer copies (`Posted`): each rank's value is dropped once, on its own
/// thread, and only after every rank has left (a rank that posted nothing counts too), so no
/// peer can still be reading it and no other thread frees it.
#[test]
fn posted_values_are_dropped_by_their_owners_once_every_rank_left() {
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let posted = Arc::new(Posted::<Tracked>::new(Duration::from_secs(5)));
    let start = Instant::now();
    let ranks: Vec<_> = (0..3)
        .map(|r| {
            let (posted, log) = (posted.clone(), log.clone());
            std::thread::spawn(move || {
                if r < 2 {
                    posted.post(r, Tracked(r, log));
                }
                // ranks leave 0, 100 and 200 ms in; rank 2 posted nothing
                std::thread::sleep(Duration::from_millis(100 * r as u64));
                let left = posted.leave(r, 3);
                (left, start.elapsed(), std::thread::current().id())
            })
        })
        .collect();
    let got: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(got[0].0, Left::Dropped);
    assert_eq!(got[1].0, Left::Dropped);
    assert_eq!(got[2].0, Left::Nothing);
    for (r, (_, when, _)) in got.iter().enumerate().take(2) {
        assert!(
            *when >= Duration::from_millis(190),
            "rank {r} left at {when:?}, before rank 2"
        );
    }
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 2, "{log:?}");
    for (r, (_, _, thread)) in got.iter().enumerate().take(2) {
        let drops: Vec<_> = log.iter().filter(|(owner, _)| *owner == r).collect();
        assert_eq!(
            drops.len(),
            1,
            "rank {r}'s value dropped {} times",
            drops.len()
        );
        assert_eq!(
            drops[0].1, *thread,
            "rank {r}'s value dropped on another thread"
        );
    }
}

/// A rank that never leaves (hung) makes the others give up after the wait and leak their
/// values: never dropped under a reader that may still be copying, never by another thread.
#[test]
fn a_rank_that_never_leaves_makes_the_others_leak_their_posted_values() {
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let posted = Posted::<Tracked>::new(Duration::from_millis(150));
    posted.post(0, Tracked(0, log.clone()));
    posted.post(1, Tracked(1, log.clone()));
    let start = Instant::now();
    assert_eq!(posted.leave(0, 2), Left::Leaked); // rank 1 never leaves
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    assert!(log.lock().unwrap().is_empty(), "a value was dropped");
    // Rank 1's value is still posted, for rank 1 to take.
    let slots = posted.slots();
    assert!(slots[1].is_some() && slots[0].is_none());
}

/// A MoE layer's router and fused experts ride in its flat buffer (three more frozen
/// tensors); DDP's and FSDP's adapters, experts' included, are one rank's.
#[test]
fn ddp_and_fsdp_with_moe_experts_equal_one_rank() {
    check("qwen3_moe", "ddp", 2, 1, 1, &[]);
    check(
        "qwen3_moe",
        "fsdp",
        2,
        1,
        1,
        &["train.activation_checkpointing=true"],
    );
}

/// `Keep::ParkMlp` (the first layer's gate and up parked, the second layer's MLP half
/// recomputed) under DDP and FSDP on two CPU ranks: each rank's step gives the loss and the
/// adapter of keeping every activation, to the bit. The trainer parks on CUDA only (pinned host
/// memory); the driver's order of gathers, recomputes and reductions is the same here.
#[test]
fn parked_gate_and_up_under_ddp_and_fsdp_equal_keeping_everything() {
    use lora_train::model::Keep;
    use lora_train::train::optim::AdamW;
    use lora_train::train::step::{adapter_params, Engine};
    use lora_train::train::train_data::Cursor;
    // the step's loss, the adapter before it and after
    type Out = (f64, Vec<Vec<f32>>, Vec<Vec<f32>>);
    let tmp = tempfile::tempdir().unwrap();
    let step = |strategy: &str, keep: Keep| -> Out {
        let text = format!(
            "{}\n{}\n",
            golden_recipe("llama_gqa", &tmp.path().join("out")),
            par(strategy, 2)
        );
        let r = recipe(
            tmp.path(),
            &text,
            &["train.micro_batch=2", "lora.dropout=0.0"],
        );
        let body = move |rank: usize, comm: Box<dyn Comm>| -> anyhow::Result<Out> {
            let s = Session::for_rank(r.clone(), comm, rank)?;
            let first = Cursor {
                epoch: 0,
                step_in_epoch: 0,
            };
            let st = s
                .steps_from(first)?
                .next()
                .transpose()?
                .expect("a first step");
            let t = &s.run.optim;
            let mut opt = AdamW::new(adapter_params(&s.model), t.betas, t.eps, t.weight_decay)?;
            let adapter = || {
                adapter_params(&s.model)
                    .iter()
                    .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
                    .collect::<candle_core::Result<Vec<_>>>()
            };
            let before = adapter()?;
            let mut engine = Engine::new(&s.model, &*s.comm, s.shards.as_ref(), keep, 1.0, None);
            let done = engine.step(&st.batches, st.denom, 0, &mut opt, 1e-2)?;
            Ok((done.loss, before, adapter()?))
        };
        launch::threads(group(2, 60), Arc::new(body), Duration::from_secs(60)).unwrap()
    };
    let park = Keep::ParkMlp {
        tail: 1,
        pending: 1,
    };
    // the first (tensor, element) where two adapters differ
    let first_diff = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        a.iter().zip(b).enumerate().find_map(|(t, (x, y))| {
            let e = x
                .iter()
                .zip(y)
                .position(|(p, q)| p.to_bits() != q.to_bits());
            e.map(|e| (t, e, x[e], y[e]))
        })
    };
    for strategy in ["ddp", "fsdp"] {
        let (loss, before, kept) = step(strategy, Keep::Acts);
        let (loss_p, _, parked) = step(strategy, park);
        assert!(loss > 1.0, "{strategy}: loss {loss}");
        assert!(
            first_diff(&kept, &before).is_some(),
            "{strategy}: the step moved no weight"
        );
        assert_eq!(loss_p, loss, "{strategy}: the loss");
        assert_eq!(kept.len(), parked.len());
        assert_eq!(
            first_diff(&parked, &kept),
            None,
            "{strategy}: the adapter after one step, parked against kept (tensor, element, values)"
        );
    }
}

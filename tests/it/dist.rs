//! DDP / FSDP on CPU thread ranks: the same adapter as one rank with the same global batch,
//! FSDP's resident memory, the collectives' numbers, and a dead rank ending the run.

use crate::common::*;
use candle_core::{Device, Tensor};
use lora_train::dist::cpu::CpuGroup;
use lora_train::dist::fsdp::resident_base_bytes;
use lora_train::dist::launch::{self, EnvRank};
use lora_train::dist::{Comm, Group};
use lora_train::train::Session;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Trains llama_gqa (8 rows of uneven length) from its init adapter; returns the adapter.
fn adapter(sets: &[&str], parallel: &str) -> HashMap<String, Tensor> {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let text = format!("{}\n{parallel}\n", golden_recipe("llama_gqa", &out));
    let mut all = vec!["train.max_grad_norm=1.0", "lora.dropout=0.0", "train.max_steps=3"];
    all.extend_from_slice(sets);
    let r = recipe(tmp.path(), &text, &all);
    let summary = lora_train::train::run(r).unwrap();
    assert_eq!(summary.steps, 3);
    load_st(&out.join("adapter_model.safetensors"))
}

fn par(strategy: &str, world: usize) -> String {
    let devs: Vec<String> = (0..world).map(|d| d.to_string()).collect();
    format!(
        "[parallel]\nstrategy = \"{strategy}\"\ndevices = [{}]\ntimeout_s = 60\n",
        devs.join(", ")
    )
}

fn assert_same(what: &str, got: &HashMap<String, Tensor>, want: &HashMap<String, Tensor>) {
    let mut k1: Vec<_> = got.keys().collect();
    let mut k2: Vec<_> = want.keys().collect();
    k1.sort();
    k2.sort();
    assert_eq!(k1, k2, "{what}: adapter keys");
    assert!(k1.len() >= 4, "{what}: {} keys", k1.len());
    // rtol 1e-5, plus 1e-6 of the tensor's largest entry for entries near zero: a rank pads
    // its rows to a different length, so f32 sums run in another order (~1e-8 absolute).
    for (k, t) in want {
        assert_close(&format!("{what} {k}"), &got[k], t, 1e-5, 1e-6);
    }
}

#[test]
fn ddp_two_ranks_of_one_row_equal_one_rank_of_two() {
    let one = adapter(&["train.micro_batch=2"], "");
    let ddp = adapter(&["train.micro_batch=1"], &par("ddp", 2));
    assert_same("ddp 2x1 vs single 1x2", &ddp, &one);
    // The adapter moved: the comparison is not between two untouched inits.
    let init = load_st(&golden_dir("llama_gqa").join("init_adapter/adapter_model.safetensors"));
    let moved = one
        .iter()
        .map(|(k, t)| max_abs_diff(t, &init[k]))
        .fold(0f32, f32::max);
    assert!(moved > 1e-4, "adapter did not train: {moved}");
}

#[test]
fn ddp_with_accumulation_and_uneven_rows_equals_one_rank() {
    // 4 rows per step, rows of 9, 11, 3, 7, ... counted tokens: each rank's share differs.
    let one = adapter(&["train.micro_batch=2", "train.grad_accum=2"], "");
    let ddp = adapter(
        &["train.micro_batch=1", "train.grad_accum=2"],
        &par("ddp", 2),
    );
    assert_same("ddp 2x1x2 vs single 1x2x2", &ddp, &one);
}

#[test]
fn fsdp_equals_one_rank_with_and_without_checkpointing() {
    let one = adapter(&["train.micro_batch=2"], "");
    let fsdp = adapter(&["train.micro_batch=1"], &par("fsdp", 2));
    assert_same("fsdp 2x1 vs single 1x2", &fsdp, &one);
    let ckpt = adapter(
        &["train.micro_batch=1", "train.activation_checkpointing=true"],
        &par("fsdp", 2),
    );
    assert_same("fsdp 2x1 checkpointed vs single 1x2", &ckpt, &one);
}

#[test]
fn fsdp_four_ranks_with_accumulation_equal_one_rank() {
    // Four ranks: the layers' flat sizes are not multiples of 4, so shards are padded.
    let one = adapter(&["train.micro_batch=4", "train.grad_accum=2"], "");
    let fsdp = adapter(
        &[
            "train.micro_batch=1",
            "train.grad_accum=2",
            "train.activation_checkpointing=true",
        ],
        &par("fsdp", 4),
    );
    assert_same("fsdp 4x1x2 vs single 1x4x2", &fsdp, &one);
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
            assert!(largest >= layer && largest < full, "{largest} vs layer {layer}");
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
    let err = launch::threads(group(3, 600), Arc::new(body), Duration::from_secs(600))
        .unwrap_err();
    let msg = format!("{err:#}");
    assert_eq!(
        msg,
        "rank 1 of 3 failed: data of rank 1: row 17 is malformed"
    );
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
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
    let err =
        launch::threads(group(2, 1), Arc::new(body), Duration::from_secs(1)).unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.starts_with("rank 0 of 2 failed: rank 0 waited 1 s in all_reduce for rank(s) [1], which never joined"),
        "{msg}"
    );
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
}

#[test]
fn launcher_environment_torchrun_and_slurm() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
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
        "WORLD_SIZE > 1 but MASTER_ADDR is not set: export MASTER_ADDR=<rank 0's host>"
    );
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

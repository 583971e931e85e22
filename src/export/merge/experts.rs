//! Merging adapters on a MoE's expert parameters (PEFT's `target_parameters`,
//! `model::EXPERT_PARAMS`).
//!
//! PEFT wraps `model.layers.N.mlp.experts` once per targeted parameter, gate_up_proj's
//! innermost: the adapter module is `….mlp.experts` (down_proj, or the one parameter targeted)
//! or `….mlp.experts.base_layer` (gate_up_proj when both are). Each holds one adapter over all
//! E experts, A [E·r, in] and B [out, r·E]: expert e's A_e is rows e·r.., its B_e the columns
//! e, E + e, ..; ΔW_e = s · B_e A_e [out, in], as model/layer_moe.rs computes it.
//!
//! The base holds the experts fused as transformers 5 does (`….experts.gate_up_proj`
//! [E, 2I, C], `….experts.down_proj` [E, C, I]) or one by one as the Hub's checkpoints do
//! (`….experts.{e}.gate_proj.weight` [I, C], `up_proj` [I, C], `down_proj` [C, I]); gate_up's
//! ΔW_e goes to gate's rows 0..I and up's rows I..2I. gpt-oss stores its fused experts x·W
//! (`gate_up_proj` [E, C, 2I], gate and up interleaved in its columns; `down_proj` [E, I, C]):
//! ΔW_e is turned to [in, out] there (`Slot::xw`). The merged model keeps the base's layout.

use crate::model::EXPERT_PARAMS;
use crate::quant::Nf4;
use anyhow::{bail, Result};
use candle_core::Tensor;

/// Where a base tensor of the experts takes its adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Slot {
    /// The adapter module (`….mlp.experts` or `….mlp.experts.base_layer`).
    pub(crate) module: String,
    /// The expert, for a tensor of one; None for the fused [E, out, in] parameter.
    expert: Option<usize>,
    /// The rows of ΔW_e it takes (start, len): gate's or up's half of gate_up; None: all.
    rows: Option<(usize, usize)>,
    /// The fused parameter stored x·W, [E, in, out] (gpt-oss).
    xw: bool,
}

/// Whether `module` (an adapter's, PEFT's name) is on expert parameters.
pub(super) fn is_module(module: &str) -> bool {
    module.ends_with(".mlp.experts") || module.ends_with(".mlp.experts.base_layer")
}

/// Whether `name` is a base tensor of a MoE's experts.
pub(super) fn is_tensor(name: &str) -> bool {
    name.starts_with("model.layers.") && name.contains(".mlp.experts.")
}

/// Whether `name` [shape] holds expert weights training keeps in NF4 under `model.quantize =
/// "nf4"` (`quant::ExpertsNf4`): the fused `gate_up_proj` [E, 2I, C] or `down_proj` [E, C, I],
/// or one expert's `{gate,up,down}_proj.weight`.
pub(super) fn is_weight(name: &str, shape: &[usize]) -> bool {
    let Some((_, rest)) = name.split_once(".mlp.experts.") else {
        return false;
    };
    match rest.split_once('.') {
        None => matches!(rest, "gate_up_proj" | "down_proj") && shape.len() == 3,
        Some((e, leaf)) => {
            e.parse::<usize>().is_ok()
                && matches!(
                    leaf,
                    "gate_proj.weight" | "up_proj.weight" | "down_proj.weight"
                )
                && shape.len() == 2
        }
    }
}

/// An expert tensor's values (`is_weight`, f32 `host` of `shape`) quantized to NF4 and
/// dequantized as training held them: each expert's gate, up and down matrix alone
/// (`quant::ExpertsNf4::quantize`), a fused gate_up's per expert in its two halves.
/// `xw`: a fused tensor stored x·W ([E, in, out], gpt-oss), round-tripped as the [E, out, in]
/// training quantizes.
pub(super) fn requant(
    name: &str,
    host: &[f32],
    shape: &[usize],
    (dq, xw): (bool, bool),
) -> Result<Vec<f32>> {
    if let (true, &[e, inp, out]) = (xw, shape) {
        if host.len() != e * inp * out {
            bail!("`{name}`: {} values for shape {shape:?}", host.len());
        }
        let v = requant(name, &turn(host, e, inp, out), &[e, out, inp], (dq, false))?;
        return Ok(turn(&v, e, out, inp));
    }
    let trip = |v: &[f32], s: &[usize]| Nf4::quantize(v, s, dq).dequantize();
    let (e, out, inp) = match shape {
        [out, inp] => return Ok(trip(host, &[*out, *inp])),
        [e, out, inp] => (*e, *out, *inp),
        _ => bail!("`{name}`: an expert tensor of shape {shape:?}"),
    };
    // gate_up's experts in halves (gate's rows, then up's), down's whole
    let (parts, rows) = match name.ends_with("gate_up_proj") {
        true if out % 2 == 0 => (2 * e, out / 2),
        true => bail!("`{name}`: gate_up_proj of odd width {out}"),
        false => (e, out),
    };
    let mut v = Vec::with_capacity(host.len());
    for piece in host.chunks(rows * inp).take(parts) {
        v.extend(trip(piece, &[rows, inp]));
    }
    if v.len() != e * out * inp {
        bail!("`{name}`: {} values for shape {shape:?}", host.len());
    }
    Ok(v)
}

/// Each of `e` matrices [rows, cols] of `v` transposed.
fn turn(v: &[f32], e: usize, rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; v.len()];
    for (src, dst) in v.chunks(rows * cols).zip(t.chunks_mut(rows * cols)).take(e) {
        for r in 0..rows {
            for c in 0..cols {
                dst[c * rows + r] = src[r * cols + c];
            }
        }
    }
    t
}

/// The slot of base tensor `name` [shape] when `targets` adapt its parameter; None otherwise
/// (not an expert tensor, or its parameter not targeted). `xw`: the fused parameters are
/// stored x·W (gpt-oss).
pub(super) fn slot(name: &str, shape: &[usize], targets: &[String], xw: bool) -> Option<Slot> {
    let (prefix, rest) = name.split_once(".mlp.experts.")?;
    let experts = format!("{prefix}.mlp.experts");
    let (gate_up, expert, rows) = match rest.split_once('.') {
        None => (rest == "gate_up_proj", None, None),
        Some((e, leaf)) => {
            let e: usize = e.parse().ok()?;
            let half = *shape.first()?;
            match leaf {
                "gate_proj.weight" => (true, Some(e), Some((0, half))),
                "up_proj.weight" => (true, Some(e), Some((half, half))),
                "down_proj.weight" => (false, Some(e), None),
                _ => return None,
            }
        }
    };
    if expert.is_none() && !gate_up && rest != "down_proj" {
        return None;
    }
    let targeted = |p: &str| targets.iter().any(|t| t == p);
    let [gu, down] = EXPERT_PARAMS.map(targeted);
    let module = match (gate_up, gu, down) {
        (true, true, true) => format!("{experts}.base_layer"),
        (true, true, false) | (false, _, true) => experts,
        _ => return None,
    };
    Some(Slot {
        module,
        expert,
        rows,
        xw: xw && expert.is_none(),
    })
}

/// An experts adapter's A [E·r, in] and B [out, r·E] as A [E, r, in] and B [E, out, r], checked
/// against the base tensors it goes into (`into`: each one's slot and shape). Errors say what
/// does not fit; the caller adds the files.
pub(super) fn shaped(
    a: &Tensor,
    b: &Tensor,
    rank: usize,
    into: &[(&Slot, &[usize])],
) -> Result<(Tensor, Tensor)> {
    let ((er, in_f), (out_f, re)) = (a.dims2()?, b.dims2()?);
    let e = er / rank.max(1);
    if rank == 0 || er % rank != 0 || re != er {
        bail!(
            "lora_A {:?} and lora_B {:?} are not E·r = E·{rank} wide",
            a.dims(),
            b.dims()
        );
    }
    if into.is_empty() {
        bail!("the base has no expert tensors for it");
    }
    for (s, shape) in into {
        let want = match (s.expert, s.rows) {
            (None, _) if s.xw => vec![e, in_f, out_f],
            (None, _) => vec![e, out_f, in_f],
            (Some(_), Some((_, len))) => vec![len, in_f],
            (Some(_), None) => vec![out_f, in_f],
        };
        let rows_fit = s.rows.is_none_or(|(_, len)| 2 * len == out_f);
        if shape.to_vec() != want || !rows_fit || s.expert.is_some_and(|x| x >= e) {
            bail!(
                "lora_A {:?} and lora_B {:?} (E = {e}) do not fit a base expert tensor {shape:?}",
                a.dims(),
                b.dims()
            );
        }
    }
    // one by one: every expert 0..E is there (gate_up's twice, as gate and up)
    let ones: std::collections::BTreeSet<usize> =
        into.iter().filter_map(|(s, _)| s.expert).collect();
    if !ones.is_empty() && ones.len() != e {
        bail!(
            "lora_A {:?} and lora_B {:?} are for E = {e} experts; the base has {}",
            a.dims(),
            b.dims(),
            ones.len()
        );
    }
    let a = a.reshape((e, rank, in_f))?;
    let b = b
        .reshape((out_f, rank, e))?
        .permute((2, 0, 1))?
        .contiguous()?;
    Ok((a, b))
}

/// s·ΔW for one slot, f32: [E, out, in] for the fused parameter ([E, in, out] stored x·W), or
/// expert e's rows [len, in].
pub(super) fn delta(a: &Tensor, b: &Tensor, scale: f64, slot: &Slot) -> Result<Tensor> {
    let d = match slot.expert {
        None if slot.xw => b.matmul(a)?.transpose(1, 2)?.contiguous()?,
        None => b.matmul(a)?,
        Some(e) => {
            let be = b.get(e)?; // [out, r]
            let be = match slot.rows {
                Some((start, len)) => be.narrow(0, start, len)?,
                None => be,
            };
            be.matmul(&a.get(e)?)?
        }
    };
    Ok((d * scale)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets(t: &[&str]) -> Vec<String> {
        t.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn slots_follow_peft_nesting_and_the_base_layout() {
        let both = targets(&[
            "q_proj",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
        ]);
        let gu = targets(&["mlp.experts.gate_up_proj"]);
        let p = "model.layers.3.mlp.experts";
        let s = |n: &str, shape: &[usize], t: &[String]| slot(&format!("{p}.{n}"), shape, t, false);
        let one = |m: &str, e, rows| Slot {
            module: m.to_string(),
            expert: Some(e),
            rows,
            xw: false,
        };
        let inner = format!("{p}.base_layer");
        assert_eq!(
            s("5.gate_proj.weight", &[24, 32], &both),
            Some(one(&inner, 5, Some((0, 24))))
        );
        assert_eq!(
            s("5.up_proj.weight", &[24, 32], &both),
            Some(one(&inner, 5, Some((24, 24))))
        );
        assert_eq!(
            s("0.down_proj.weight", &[32, 24], &both),
            Some(one(p, 0, None))
        );
        // one parameter targeted: its adapter is the outer (only) wrapper
        assert_eq!(
            s("5.gate_proj.weight", &[24, 32], &gu).map(|x| x.module),
            Some(p.to_string())
        );
        assert_eq!(s("0.down_proj.weight", &[32, 24], &gu), None);
        let fused = s("gate_up_proj", &[8, 48, 32], &both).map(|x| (x.module, x.expert));
        assert_eq!(fused, Some((inner, None)));
        assert_eq!(
            s("down_proj", &[8, 32, 24], &both).map(|x| x.expert),
            Some(None)
        );
        assert_eq!(s("0.gate_proj.bias", &[24], &both), None);
        assert_eq!(
            slot("model.layers.3.mlp.gate.weight", &[8, 32], &both, false),
            None
        );
        // gpt-oss: the fused parameters x·W; its biases take no adapter
        let oss = |n: &str| slot(&format!("{p}.{n}"), &[8, 32, 48], &both, true);
        assert!(oss("gate_up_proj").is_some_and(|s| s.xw));
        assert_eq!(oss("gate_up_proj_bias"), None);
        assert_eq!(oss("down_proj_bias"), None);
    }

    /// A fused expert tensor's NF4 round trip is each expert's matrices' (gate_up's two halves
    /// apart), as the one-by-one layout's tensors are each alone; the other tensors are not
    /// expert weights.
    #[test]
    fn requant_goes_matrix_by_matrix() {
        let (e, i, c) = (2, 8, 16); // 128 weights a matrix: 2 blocks
        let v: Vec<f32> = (0..e * 2 * i * c)
            .map(|x| (x as f32 * 0.41).sin())
            .collect();
        let p = "model.layers.1.mlp.experts";
        let fused = requant(
            &format!("{p}.gate_up_proj"),
            &v,
            &[e, 2 * i, c],
            (true, false),
        );
        let fused = fused.unwrap();
        let one = |m: &[f32]| Nf4::quantize(m, &[i, c], true).dequantize();
        let want: Vec<f32> = v.chunks(i * c).flat_map(one).collect();
        assert_eq!(fused, want);
        let single = requant(
            &format!("{p}.1.up_proj.weight"),
            &v[..i * c],
            &[i, c],
            (true, false),
        );
        assert_eq!(single.unwrap(), one(&v[..i * c]));
        let down = requant(&format!("{p}.down_proj"), &v, &[e, c, 2 * i], (true, false));
        let down = down.unwrap();
        let whole = |m: &[f32]| Nf4::quantize(m, &[c, 2 * i], true).dequantize();
        assert_eq!(
            down,
            v.chunks(2 * i * c).flat_map(whole).collect::<Vec<_>>()
        );
        assert!(is_weight(&format!("{p}.gate_up_proj"), &[e, 2 * i, c]));
        assert!(is_weight(&format!("{p}.3.down_proj.weight"), &[c, i]));
        assert!(!is_weight("model.layers.1.mlp.gate.weight", &[e, c]));
        assert!(!is_weight(&format!("{p}.3.down_proj.bias"), &[c]));
        // x·W (gpt-oss): the same round trip on each expert's turned matrix, turned back
        let xw = turn(&v, e, 2 * i, c); // [e, c, 2i]
        let got = requant(
            &format!("{p}.gate_up_proj"),
            &xw,
            &[e, c, 2 * i],
            (true, true),
        );
        assert_eq!(got.unwrap(), turn(&fused, e, 2 * i, c));
    }

    #[test]
    fn delta_of_one_expert_is_its_slice_of_the_fused_delta() {
        let dev = candle_core::Device::Cpu;
        let (e, r, out, inp) = (3, 2, 6, 5);
        let a = Tensor::randn(0f32, 1.0, (e * r, inp), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, (out, r * e), &dev).unwrap();
        let fused = Slot {
            module: "m".into(),
            expert: None,
            rows: None,
            xw: false,
        };
        let up = |x| Slot {
            module: "m".into(),
            expert: Some(x),
            rows: Some((3, 3)),
            xw: false,
        };
        let (f_shape, u_shape) = ([e, out, inp], [3, inp]);
        let into = [(&fused, &f_shape[..])];
        let (a3, b3) = shaped(&a, &b, r, &into).unwrap();
        let ups = [up(0), up(1), up(2)];
        let one_by_one: Vec<_> = ups.iter().map(|s| (s, &u_shape[..])).collect();
        assert!(shaped(&a, &b, r, &one_by_one).is_ok());
        let all = delta(&a3, &b3, 0.5, &fused).unwrap();
        let one = delta(&a3, &b3, 0.5, &up(1)).unwrap();
        let want = all.get(1).unwrap().narrow(0, 3, 3).unwrap();
        let diff = (one - &want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-6);
        // expert 1's B_1 is B's columns 1, 1 + E: ΔW_1[o, i] = s Σ_j B[o, j·E + 1] A[r + j, i]
        let (av, bv) = (a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        let w = |o: usize, i: usize| (0..r).map(|j| bv[o][j * e + 1] * av[r + j][i]).sum::<f32>();
        let got = all.get(1).unwrap().to_vec2::<f32>().unwrap();
        assert!((got[4][2] - 0.5 * w(4, 2)).abs() < 1e-5);
        // a width that is not E·r, or a base tensor of another shape, is refused
        assert!(shaped(&a, &b.narrow(1, 0, 5).unwrap(), r, &into).is_err());
        let bad = [(&fused, &[e, out, inp + 1][..])];
        assert!(shaped(&a, &b, r, &bad).is_err());
        // one by one, but fewer experts in the base than the adapter's E
        assert!(shaped(&a, &b, r, &one_by_one[..2]).is_err());
        // x·W: the fused delta turned, and the base's [E, in, out] taken
        let turned = Slot { xw: true, ..fused };
        let t_shape = [e, inp, out];
        assert!(shaped(&a, &b, r, &[(&turned, &t_shape[..])]).is_ok());
        assert!(shaped(&a, &b, r, &[(&turned, &f_shape[..])]).is_err());
        let t = delta(&a3, &b3, 0.5, &turned).unwrap();
        let back = t.transpose(1, 2).unwrap();
        let diff = (back - &all).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
    }
}

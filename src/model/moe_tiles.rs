//! A MoE layer's experts run a tile of experts at a time (model/layer_moe.rs's forward and
//! backward over the grouped rows). Experts in the model's dtype are one tile of all E, their
//! stacks as they are. NF4 experts (`quant::ExpertsNf4`) are dequantized a tile at a time
//! (`quant::experts::tile_experts`: ~256 MiB of weights) into a scratch that the next tile
//! reuses on CUDA, and each tile's rows go through the same grouped GEMMs; the backward
//! recomputes a tile's forward and runs its backward on one dequantization.
//!
//! Shapes: P grouped rows (expert order), C hidden, t experts in a tile.

use super::layer_moe::{Adapters, ExpertActs, Grad, Moe, PerExpert, Weights};
use crate::ops::moe_rows;
use crate::quant::experts::{tile_experts, Scratch};
use candle_core::{DType, Result, Tensor};

/// A tile: experts [e0, e0 + n), their rows [row0, row0 + rows) of the grouped rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tile {
    pub(super) e0: usize,
    pub(super) n: usize,
    pub(super) row0: usize,
    pub(super) rows: usize,
}

/// The tiles of `per` experts over `counts` (rows of each expert, expert order).
pub(super) fn tiles(counts: &[usize], per: usize) -> Vec<Tile> {
    let (mut v, mut row0) = (Vec::new(), 0);
    for (i, c) in counts.chunks(per.max(1)).enumerate() {
        let rows = c.iter().sum();
        v.push(Tile {
            e0: i * per.max(1),
            n: c.len(),
            row0,
            rows,
        });
        row0 += rows;
    }
    v
}

/// What a tile's backward gives: dL/dx and dL/dw of its rows, and its experts' adapter
/// gradients (gate_up's, down's).
type TileGrads = (Tensor, Tensor, Option<Grad>, Option<Grad>);

impl Moe {
    /// The experts a tile takes: all E in the model's dtype, `tile_experts` in NF4.
    fn tile_size(&self, dt: DType) -> usize {
        match &self.nf4 {
            Some(q) => {
                let (e, i, c) = q.shape();
                tile_experts(e, i, c, dt.size_in_bytes())
            }
            None => self.spec.experts,
        }
    }

    /// A tile's weights (gate_up [n, 2I, C], down [n, C, I]): views of the stacks, or the NF4
    /// experts dequantized to `dt` (into `scratch` where given).
    fn weights(
        &self,
        t: Tile,
        dt: DType,
        scratch: Option<&mut Scratch>,
    ) -> Result<(Tensor, Tensor)> {
        match &self.nf4 {
            Some(q) => q.tile((t.e0, t.n), dt, scratch),
            None => Ok((
                self.gate_up.narrow(0, t.e0, t.n)?,
                self.down.narrow(0, t.e0, t.n)?,
            )),
        }
    }

    /// The experts' output y [P, C] over the grouped rows x [P, C] (before the routing
    /// weights). With `graph` (the reference forward) each tile's weights are fresh, so
    /// autograd's graph keeps what it read; else one scratch serves every tile.
    pub(super) fn experts_y(
        &self,
        x: &Tensor,
        counts: &[usize],
        ads: Adapters,
        graph: bool,
    ) -> Result<Tensor> {
        self.experts_y_per(self.tile_size(x.dtype()), x, counts, ads, graph)
    }

    /// `experts_y` in tiles of `per` experts.
    fn experts_y_per(
        &self,
        per: usize,
        x: &Tensor,
        counts: &[usize],
        ads: Adapters,
        graph: bool,
    ) -> Result<Tensor> {
        let dt = x.dtype();
        let mut scratch = Scratch::new(per);
        let mut ys = Vec::new();
        for t in tiles(counts, per).into_iter().filter(|t| t.rows > 0) {
            let (gu, dn) = self.weights(t, dt, (!graph).then_some(&mut scratch))?;
            let (ga, da) = (tile_of(ads.0, t)?, tile_of(ads.1, t)?);
            let xt = x.narrow(0, t.row0, t.rows)?;
            let c = &counts[t.e0..t.e0 + t.n];
            let ads = (ga.as_ref(), da.as_ref());
            let (y, _) = self.experts_fwd((&gu, &dn, t.e0), &xt, c, ads)?;
            ys.push(y);
        }
        cat_rows(ys, (0, x.dim(1)?), x)
    }

    /// The backward of `experts_y` for g = dL/d(the layer's output) [m, C], with the grouped
    /// rows' tokens [P] u32 and routing weights [P] f32: dL/dx [P, C], dL/dw [P] f32, and the
    /// experts' adapter gradients (gate_up's, down's: dA [E, r, in], dB [E, out, r] f32).
    #[allow(clippy::type_complexity)]
    pub(super) fn experts_grad(
        &self,
        x: &Tensor,
        (g, tokens, w): (&Tensor, &Tensor, &Tensor),
        counts: &[usize],
        ads: Adapters,
    ) -> Result<(Tensor, Tensor, Option<Grad>, Option<Grad>)> {
        self.experts_grad_per(self.tile_size(x.dtype()), x, (g, tokens, w), counts, ads)
    }

    /// `experts_grad` in tiles of `per` experts.
    #[allow(clippy::type_complexity)]
    fn experts_grad_per(
        &self,
        per: usize,
        x: &Tensor,
        (g, tokens, w): (&Tensor, &Tensor, &Tensor),
        counts: &[usize],
        ads: Adapters,
    ) -> Result<(Tensor, Tensor, Option<Grad>, Option<Grad>)> {
        let dt = x.dtype();
        let mut scratch = Scratch::new(per);
        let (mut dxs, mut dws) = (Vec::new(), Vec::new());
        let (mut gus, mut downs) = (Vec::new(), Vec::new());
        for t in tiles(counts, per) {
            let (ga, da) = (tile_of(ads.0, t)?, tile_of(ads.1, t)?);
            if t.rows == 0 {
                gus.extend(ga.as_ref().map(|p| p.zero_grad(t.n)).transpose()?);
                downs.extend(da.as_ref().map(|p| p.zero_grad(t.n)).transpose()?);
                continue;
            }
            let rows = |v: &Tensor| v.narrow(0, t.row0, t.rows);
            let c = &counts[t.e0..t.e0 + t.n];
            let (gu, dn) = self.weights(t, dt, Some(&mut scratch))?;
            let tile_ads = (ga.as_ref(), da.as_ref());
            let (dx, dw, gg, gd) = self.tile_grad(
                (&gu, &dn, t.e0),
                &rows(x)?,
                (g, &rows(tokens)?, &rows(w)?),
                c,
                tile_ads,
            )?;
            dxs.push(dx);
            dws.push(dw);
            gus.extend(gg);
            downs.extend(gd);
        }
        let dx = cat_rows(dxs, (0, x.dim(1)?), x)?;
        let dw = match dws.len() {
            1 => dws.remove(0),
            0 => Tensor::zeros(0, DType::F32, x.device())?,
            _ => Tensor::cat(&dws, 0)?,
        };
        Ok((dx, dw, cat_grads(gus)?, cat_grads(downs)?))
    }

    /// One tile's forward again and its backward (`experts_fwd`, `experts_bwd`) on its rows.
    fn tile_grad(
        &self,
        wts: Weights,
        x: &Tensor,
        (g, tokens, w): (&Tensor, &Tensor, &Tensor),
        counts: &[usize],
        ads: Adapters,
    ) -> Result<TileGrads> {
        let (y, acts): (Tensor, ExpertActs) = self.experts_fwd(wts, x, counts, ads)?;
        // dL/dy [rows, C] (the weights applied) and dL/dw [rows] f32
        let (gy, dw) = moe_rows::scatter_grad(g, tokens, w, &y)?;
        drop(y);
        let (dx, gu, down) = self.experts_bwd(wts, (x, acts), &gy, counts, ads)?;
        Ok((dx, dw, gu, down))
    }
}

/// An adapter's share of a tile's experts (the whole adapter when the tile is all of them).
fn tile_of(p: Option<&PerExpert>, t: Tile) -> Result<Option<PerExpert>> {
    p.map(|p| p.tile(t.e0, t.n)).transpose()
}

/// Tiles' rows joined in order (one as it is; none: an empty [0, C] like `like`).
fn cat_rows(mut parts: Vec<Tensor>, (zero, c): (usize, usize), like: &Tensor) -> Result<Tensor> {
    match parts.len() {
        1 => Ok(parts.remove(0)),
        0 => Tensor::zeros((zero, c), like.dtype(), like.device()),
        _ => Tensor::cat(&parts, 0),
    }
}

/// Tiles' adapter gradients joined along the experts (None without the adapter).
fn cat_grads(mut parts: Vec<Grad>) -> Result<Option<Grad>> {
    match parts.len() {
        0 => Ok(None),
        1 => Ok(Some(parts.remove(0))),
        _ => {
            let (a, b): (Vec<Tensor>, Vec<Tensor>) = parts.into_iter().unzip();
            Ok(Some((Tensor::cat(&a, 0)?, Tensor::cat(&b, 0)?)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::LoraSpec;
    use crate::model::family::{MoeSpec, OssMoe};
    use crate::model::layer_moe::{ExpertLora, OssBiases};
    use crate::model::Lora;
    use candle_core::{Device, Var};

    /// A random MoE block of 5 experts (C 64, I 32), both parameters adapted with B ≠ 0, its
    /// experts in NF4 (double quant) or, `dense`, as their dequantized f32 weights; `oss`:
    /// gpt-oss's (interleaved gate_up, biases, clamped SwiGLU, top-k softmax router).
    fn moe(dense: bool, oss: bool) -> Moe {
        let (e, c, i, r) = (5, 64, 32, 2);
        let dev = Device::Cpu;
        let rnd = |shape: &[usize], seed: u64| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|x| (x as f32 * 0.7315 + seed as f32).sin() * 0.05)
                .collect();
            Tensor::from_vec(v, shape, &dev).unwrap()
        };
        let spec = LoraSpec {
            rank: e * r,
            alpha: 4.0,
            dropout: 0.0,
            rslora: false,
            dora: false,
            targets: vec![],
        };
        let lora = |in_f: usize, out_f: usize, k: u64| {
            let mut l = Lora::init(&spec, in_f, out_f, 7, &[k], &dev).unwrap();
            l.b = Var::from_tensor(&rnd(&[out_f, e * r], k)).unwrap();
            l.scale = 2.0;
            Some(ExpertLora {
                name: format!("experts{k}"),
                lora: l,
            })
        };
        let mut m = Moe {
            router: rnd(&[e, c], 1),
            gate_up: rnd(&[e, 2 * i, c], 2),
            down: rnd(&[e, c, i], 3),
            spec: MoeSpec {
                experts: e,
                top_k: 2,
                inter: i,
                norm_topk: !oss,
                oss: oss.then_some(OssMoe {
                    alpha: 1.702,
                    limit: 7.0,
                }),
            },
            gate_up_lora: lora(c, 2 * i, 4),
            down_lora: lora(i, c, 5),
            nf4: None,
            layer: 0,
            biases: oss.then(|| OssBiases {
                router: rnd(&[e], 6),
                gate_up: (rnd(&[e, 2 * i], 7) * 20.0).unwrap(),
                down: (rnd(&[e, c], 8) * 20.0).unwrap(),
            }),
        };
        m.quantize(true).unwrap();
        if dense {
            let q = m.nf4.take().unwrap();
            (m.gate_up, m.down) = q.dequantize(DType::F32).unwrap();
        }
        m
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
        d.max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// NF4 experts in tiles of 2 (3 tiles, one without rows) give the dense dequantized
    /// weights' output, dL/dx, dL/dw and adapter gradients, in f32 within 1e-5; Qwen3-MoE's
    /// and gpt-oss's (each tile its experts' biases).
    #[test]
    fn nf4_tiles_equal_the_dequantized_experts() {
        for oss in [false, true] {
            tiles_equal_dense(oss);
        }
    }

    fn tiles_equal_dense(oss: bool) {
        let (q, d) = (moe(false, oss), moe(true, oss));
        let dev = Device::Cpu;
        let counts = [3usize, 0, 0, 4, 1];
        let (p, c, m) = (8, 64, 5);
        let x = Tensor::randn(0f32, 1.0, (p, c), &dev).unwrap();
        let g = Tensor::randn(0f32, 1.0, (m, c), &dev).unwrap();
        let tokens = Tensor::new(&[0u32, 1, 2, 3, 4, 0, 1, 2], &dev).unwrap();
        let w = Tensor::rand(0f32, 1.0, p, &dev).unwrap();
        let ads = |m: &Moe| {
            let of = |l| PerExpert::of(l, 5, DType::F32, false).unwrap();
            (of(&m.gate_up_lora), of(&m.down_lora))
        };
        let (qa, da) = (ads(&q), ads(&d));
        let (qa, da) = (
            (qa.0.as_ref(), qa.1.as_ref()),
            (da.0.as_ref(), da.1.as_ref()),
        );
        let yq = q.experts_y_per(2, &x, &counts, qa, false).unwrap();
        let yd = d.experts_y_per(5, &x, &counts, da, false).unwrap();
        assert!(max_diff(&yq, &yd) < 1e-5, "y {}", max_diff(&yq, &yd));
        let gq = q
            .experts_grad_per(2, &x, (&g, &tokens, &w), &counts, qa)
            .unwrap();
        let gd = d
            .experts_grad_per(5, &x, (&g, &tokens, &w), &counts, da)
            .unwrap();
        assert!(max_diff(&gq.0, &gd.0) < 1e-5, "dx");
        assert!(max_diff(&gq.1, &gd.1) < 1e-5, "dw");
        for (a, b) in [(gq.2, gd.2), (gq.3, gd.3)] {
            let ((aa, ab), (ba, bb)) = (a.unwrap(), b.unwrap());
            assert_eq!(aa.dims(), ba.dims());
            assert!(max_diff(&aa, &ba) < 1e-5, "dA");
            assert!(max_diff(&ab, &bb) < 1e-5, "dB");
        }
        // the experts without rows get zero gradients
        let (da_q, _) = q
            .experts_grad_per(2, &x, (&g, &tokens, &w), &counts, qa)
            .unwrap()
            .2
            .unwrap();
        let e1 = da_q.get(1).unwrap().abs().unwrap().sum_all().unwrap();
        assert_eq!(e1.to_scalar::<f32>().unwrap(), 0.0);
    }

    #[test]
    fn tiles_cover_every_expert_and_row_in_order() {
        let t = tiles(&[2, 0, 3, 0, 0, 1, 4], 3);
        let want = [(0, 3, 0, 5), (3, 3, 5, 1), (6, 1, 6, 4)];
        let got: Vec<_> = t.iter().map(|t| (t.e0, t.n, t.row0, t.rows)).collect();
        assert_eq!(got, want);
        assert_eq!(tiles(&[1, 2], 8).len(), 1);
    }
}

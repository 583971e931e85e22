//! Attach a custom backward to a value computed without a graph.
//!
//! `attach3(a, b, c, value, backward)` returns a tensor equal to `value` whose graph node has
//! inputs (a, b, c) and whose gradients are whatever `backward(a, b, c, out, grad)` says.
//! The forward work is done by ordinary tensor code on detached inputs, so none of its
//! intermediates are kept by autograd: the graph holds the three inputs and the output only.
//! (The output is one device copy of `value`, which is dropped once copied.)

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};
use std::sync::{Arc, Mutex};

pub(crate) type Grads3 = (Option<Tensor>, Option<Tensor>, Option<Tensor>);
pub(crate) type Backward3 =
    dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor) -> Result<Grads3> + Send + Sync;

struct Attach3 {
    value: Mutex<Option<Tensor>>,
    backward: Box<Backward3>,
}

pub(crate) fn attach3(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    value: Tensor,
    backward: Box<Backward3>,
) -> Result<Tensor> {
    let value = if value.is_contiguous() && value.layout().start_offset() == 0 {
        value
    } else {
        value.force_contiguous()? // a fresh [shape] buffer, offset 0
    };
    let op = Attach3 {
        value: Mutex::new(Some(value)),
        backward,
    };
    a.apply_op3_arc(b, c, Arc::new(Box::new(op)))
}

impl Attach3 {
    fn take(&self) -> Result<Tensor> {
        self.value
            .lock()
            .map_err(|_| candle_core::Error::Msg("attach: poisoned".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("attach: forward ran twice".into()))
    }
}

impl CustomOp3 for Attach3 {
    fn name(&self) -> &'static str {
        "attach"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let v = self.take()?;
        let (s, l) = v.storage_and_layout();
        match &*s {
            Storage::Cpu(s) => Ok((s.try_clone(l)?, l.shape().clone())),
            _ => candle_core::bail!("attach: value is not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let v = self.take()?;
        let (s, l) = v.storage_and_layout();
        match &*s {
            Storage::Cuda(s) => Ok((s.try_clone(l)?, l.shape().clone())),
            _ => candle_core::bail!("attach: value is not on the GPU"),
        }
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        (self.backward)(a, b, c, res, grad)
    }
}

//! Reading a checkpoint ahead of its upload. The weights are memory-mapped; each tensor is
//! copied from the mapping straight to the device, and a page the disk has not delivered yet
//! stalls that copy. So as layer l loads, the kernel is asked (madvise WILLNEED) to read the
//! next layers' bytes into the page cache in the background: the disk streams while the
//! device copies, and a load takes about as long as the read alone. Only a few layers are
//! asked for ahead, so a model larger than the host's memory does not crowd it out.

use candle_core::safetensors::MmapedSafetensors;
use std::cell::Cell;
use std::collections::BTreeMap;

/// Layers asked for ahead of the one loading.
const AHEAD: usize = 2;

/// The byte ranges of each decoder layer's tensors, and how far the reading is asked for.
pub(crate) struct Prefetch {
    /// Layer → (address, length) of its tensors in the mappings.
    layers: BTreeMap<usize, Vec<(usize, usize)>>,
    /// The other tensors (embedding, final norm, head), asked for with layer 0.
    rest: Vec<(usize, usize)>,
    /// Layers below this were asked for already.
    asked: Cell<usize>,
}

impl Prefetch {
    pub(crate) fn new(st: &MmapedSafetensors) -> Prefetch {
        let mut layers: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        let mut rest = Vec::new();
        for (name, view) in st.tensors() {
            let d = view.data();
            let range = (d.as_ptr() as usize, d.len());
            match layer_of(&name) {
                Some(l) => layers.entry(l).or_default().push(range),
                None => rest.push(range),
            }
        }
        Prefetch {
            layers,
            rest,
            asked: Cell::new(0),
        }
    }

    /// The tensor `name` is about to load: the layers after its own are asked for.
    pub(crate) fn loading(&self, name: &str) {
        if self.asked.get() == 0 {
            self.rest.iter().for_each(|&r| will_need(r));
        }
        let last = self.layers.keys().last().copied().unwrap_or(0);
        let upto = (layer_of(name).unwrap_or(0) + AHEAD).min(last);
        while self.asked.get() <= upto {
            if let Some(ranges) = self.layers.get(&self.asked.get()) {
                ranges.iter().for_each(|&r| will_need(r));
            }
            self.asked.set(self.asked.get() + 1);
        }
    }
}

/// `model.layers.{l}.…` → l.
fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("model.layers.")?;
    rest.split('.').next()?.parse().ok()
}

/// Asks the kernel to read [addr, addr + len) of a mapping in the background.
#[cfg(unix)]
fn will_need((addr, len): (usize, usize)) {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let start = addr - addr % page;
    // SAFETY: the range lies within a live read-only mapping (the tensor's bytes, widened to
    // page boundaries, which the mapping covers); WILLNEED only schedules reads.
    unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            len + (addr - start),
            libc::MADV_WILLNEED,
        );
    }
}

#[cfg(not(unix))]
fn will_need(_: (usize, usize)) {}

#[cfg(test)]
mod tests {
    #[test]
    fn layer_of_reads_the_index() {
        assert_eq!(
            super::layer_of("model.layers.12.mlp.up_proj.weight"),
            Some(12)
        );
        assert_eq!(super::layer_of("model.embed_tokens.weight"), None);
        assert_eq!(super::layer_of("lm_head.weight"), None);
    }
}

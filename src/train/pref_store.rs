//! The file `train.precompute_ref` keeps the reference's log-probabilities in,
//! `<output.dir>/reference_logps.bin`, and what decides them (its key).
//!
//! Layout: [`MAGIC`]; the key's length (u64 LE) and the key (UTF-8, one `name = value` line
//! each); the count n (u64 LE) and n f32 LE values; a SHA-256 of all before it. A file is
//! trusted only when its size is exactly what the expected key and count make (checked before
//! anything is read into memory), its magic, key and count are the expected ones and its
//! checksum holds; otherwise [`decode`] says why, naming the key's first differing line, and
//! the values are computed again.

use super::session::Session;
use super::train_data::TrainData;
use anyhow::{Context, Result};
use ring::digest::{digest, SHA256};
use std::path::{Path, PathBuf};

/// The file's first bytes (and its format's version).
pub(crate) const MAGIC: &[u8] = b"lora-train reference log-probs 1\n";
/// The file's name in the output directory.
pub(crate) const FILE: &str = "reference_logps.bin";
const SUM: usize = 32;

/// The file of the run writing into `out_dir`.
pub(crate) fn path(out_dir: &Path) -> PathBuf {
    out_dir.join(FILE)
}

/// The file's bytes: `key` (as [`key`] gives it) and `values`.
pub(crate) fn encode(key: &str, values: &[f32]) -> Vec<u8> {
    let mut b = Vec::with_capacity(MAGIC.len() + 16 + key.len() + 4 * values.len() + SUM);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&(key.len() as u64).to_le_bytes());
    b.extend_from_slice(key.as_bytes());
    b.extend_from_slice(&(values.len() as u64).to_le_bytes());
    for v in values {
        b.extend_from_slice(&v.to_le_bytes());
    }
    let sum = digest(&SHA256, &b);
    b.extend_from_slice(sum.as_ref());
    b
}

/// The size a file of `key` and `n` values has.
pub(crate) fn size(key: &str, n: usize) -> u64 {
    (MAGIC.len() + 8 + key.len() + 8 + SUM) as u64 + 4 * n as u64
}

/// The values of `bytes` when they are a whole file of `key` with `n` values; else why not.
pub(crate) fn decode(bytes: &[u8], key: &str, n: usize) -> std::result::Result<Vec<f32>, String> {
    let short = || {
        format!(
            "it holds {} bytes, short of a whole file (truncated)",
            bytes.len()
        )
    };
    let Some(rest) = bytes.strip_prefix(MAGIC) else {
        return Err(match MAGIC.starts_with(bytes) {
            true => short(),
            false => "it is not a reference log-probs file of this version".into(),
        });
    };
    let (len, rest) = split_u64(rest).ok_or_else(short)?;
    let k = usize::try_from(len)
        .ok()
        .and_then(|len| rest.get(..len))
        .ok_or_else(short)?;
    if k != key.as_bytes() {
        return Err(differs(&String::from_utf8_lossy(k), key));
    }
    let (count, vals) = split_u64(&rest[k.len()..]).ok_or_else(short)?;
    if count != n as u64 {
        return Err(format!("it holds {count} values where this run has {n}"));
    }
    match vals.len().cmp(&(4 * n + SUM)) {
        std::cmp::Ordering::Less => return Err(short()),
        std::cmp::Ordering::Greater => return Err("it has bytes after its end".into()),
        std::cmp::Ordering::Equal => {}
    }
    let (body, sum) = bytes.split_at(bytes.len() - SUM);
    if digest(&SHA256, body).as_ref() != sum {
        return Err("its checksum does not match its contents (damaged)".into());
    }
    Ok(vals[..4 * n]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A u64 LE at the start of `b`, and the rest.
fn split_u64(b: &[u8]) -> Option<(u64, &[u8])> {
    let (h, rest) = (b.get(..8)?, b.get(8..)?);
    Some((u64::from_le_bytes(h.try_into().ok()?), rest))
}

/// Why a file of key `got` is not this run's (`want`): the first field, in the key's order
/// (the recipe's fields first), whose value differs or which one of them lacks.
fn differs(got: &str, want: &str) -> String {
    let fields = |k: &str| -> Vec<(String, String)> {
        k.lines()
            .map(|l| match l.split_once(" = ") {
                Some((n, v)) => (n.to_string(), v.to_string()),
                None => (l.to_string(), String::new()),
            })
            .collect()
    };
    let (g, w) = (fields(got), fields(want));
    let value = |f: &[(String, String)], n: &str| f.iter().find(|x| x.0 == n).map(|x| x.1.clone());
    let differ = |n: &&String| value(&g, n) != value(&w, n);
    let mut names = w.iter().chain(&g).map(|x| &x.0);
    let first = (names.clone())
        .filter(|n| n.starts_with("recipe."))
        .find(differ)
        .or_else(|| names.find(differ));
    match first {
        Some(n) => format!("it was computed with another {n}"),
        None => "its key differs".into(),
    }
}

/// The values of the file at `p` for `key` and `n` values; Err: why they are not trusted
/// (absent, unreadable, another run's, damaged).
pub(crate) fn read(p: &Path, key: &str, n: usize) -> std::result::Result<Vec<f32>, String> {
    let meta = std::fs::metadata(p).map_err(|_| "there is none yet".to_string())?;
    // Bounded before it is read: this run's file is `size(key, n)` bytes; one far larger is
    // not (a key of another run may be somewhat longer, and is named by `decode`).
    if meta.len() > size(key, n) + (1 << 20) {
        return Err(format!(
            "it holds {} bytes where this run's makes {}",
            meta.len(),
            size(key, n)
        ));
    }
    let bytes = std::fs::read(p).map_err(|e| format!("it cannot be read: {e}"))?;
    decode(&bytes, key, n)
}

fn sha256_hex(bytes: &[u8]) -> String {
    digest(&SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A file's SHA-256 (hex); "-" when it is absent.
fn file_sum(p: &Path) -> Result<String> {
    match p.is_file() {
        true => Ok(sha256_hex(
            &std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?,
        )),
        false => Ok("-".into()),
    }
}

/// What decides the stored values, one `name = value` line each: the recipe's fields that
/// change the numbers (the data files, seq_len, max_prompt_len, the objective and its
/// reference, the batch, the seed, the model's path ...), the data's fingerprint, the device,
/// dtype, kernels and ranks, a pair's layout (`data::pref_batch::PAIR_LAYOUT`: a store of
/// another layout is recomputed, named by this line), the base's config.json (its SHA-256) and
/// weight files (name, size, modification time), and the init adapter's files (SHA-256).
pub(crate) fn key(s: &Session, d: &TrainData) -> Result<String> {
    let run = &s.run;
    let mut lines: Vec<(String, String)> = super::fingerprint::recipe(&run.recipe)
        .into_iter()
        .map(|(k, v)| (format!("recipe.{k}"), v))
        .collect();
    lines.push(("data.fingerprint".into(), super::fingerprint::data(d)?));
    lines.push(("data.examples".into(), d.data()?.examples.len().to_string()));
    lines.push((
        "reference".into(),
        format!("{:?}", run.objective.reference()),
    ));
    lines.push(("objective".into(), format!("{:?}", run.objective)));
    if !run.objective.is_kto() {
        let layout = crate::data::pref_batch::PAIR_LAYOUT;
        lines.push(("pair_layout".into(), layout.into()));
    }
    lines.push(("device".into(), format!("{:?}", run.device)));
    lines.push(("dtype".into(), format!("{:?}", run.dtype)));
    lines.push(("quant".into(), format!("{:?}", run.quant)));
    lines.push(("kernels".into(), format!("{:?}", run.kernels)));
    lines.push(("ranks".into(), d.world.to_string()));
    if let Some(dir) = &s.base_dir {
        lines.push(("model.config".into(), file_sum(&dir.join("config.json"))?));
        lines.push(("model.weights".into(), weight_files(dir)));
    }
    if let Some(dir) = &run.init_adapter {
        for f in [crate::util::WEIGHTS, crate::util::CONFIG] {
            lines.push((format!("init_adapter.{f}"), file_sum(&dir.join(f))?));
        }
    }
    Ok(lines
        .iter()
        .map(|(k, v)| format!("{k} = {}\n", v.replace('\n', " ")))
        .collect())
}

/// The base's weight files: name, size and modification time each.
fn weight_files(dir: &Path) -> String {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| {
            let m = std::fs::metadata(e.path()).ok();
            let len = m.as_ref().map_or(0, |m| m.len());
            let mtime = m
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            format!("{}:{len}:{mtime}", e.file_name().to_string_lossy())
        })
        .collect();
    v.sort();
    v.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "recipe.data.seq_len = 64\nreference = Some(Base)\nranks = 1\n";

    fn file() -> Vec<u8> {
        encode(KEY, &[-1.5, -20.25, -0.0, 3.0e-7])
    }

    #[test]
    fn a_whole_file_of_the_key_gives_its_values_back_bit_for_bit() {
        let b = file();
        assert_eq!(b.len() as u64, size(KEY, 4));
        let v = decode(&b, KEY, 4).unwrap();
        let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        let want: Vec<u32> = [-1.5f32, -20.25, -0.0, 3.0e-7]
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(bits, want);
        let dir = tempfile::tempdir().unwrap();
        let p = path(dir.path());
        crate::util::atomic_write(&p, &b).unwrap();
        assert_eq!(read(&p, KEY, 4).unwrap(), v);
    }

    #[test]
    fn a_truncated_file_is_not_trusted() {
        let b = file();
        for cut in [0, 1, MAGIC.len() + 3, b.len() - 33, b.len() - 1] {
            let e = decode(&b[..cut], KEY, 4).unwrap_err();
            assert!(e.contains("truncated"), "{cut}: {e}");
        }
        let dir = tempfile::tempdir().unwrap();
        let p = path(dir.path());
        std::fs::write(&p, &b[..b.len() - 5]).unwrap();
        assert!(read(&p, KEY, 4).unwrap_err().contains("truncated"));
        // a far larger file is not read at all
        std::fs::write(&p, vec![0u8; size(KEY, 4) as usize + (2 << 20)]).unwrap();
        assert!(read(&p, KEY, 4).unwrap_err().contains("this run's makes"));
        assert!(read(&dir.path().join("none"), KEY, 4)
            .unwrap_err()
            .contains("none yet"));
    }

    #[test]
    fn another_key_is_named_by_its_first_differing_field() {
        let other = KEY.replace("seq_len = 64", "seq_len = 65");
        let e = decode(&encode(&other, &[1.0; 4]), KEY, 4).unwrap_err();
        assert_eq!(e, "it was computed with another recipe.data.seq_len");
        let other = KEY.replace("Some(Base)", "Some(InitAdapter)");
        let e = decode(&encode(&other, &[1.0; 4]), KEY, 4).unwrap_err();
        assert_eq!(e, "it was computed with another reference");
        let other = format!("{KEY}init_adapter.adapter_model.safetensors = 00ff\n");
        let e = decode(&encode(&other, &[1.0; 4]), KEY, 4).unwrap_err();
        assert_eq!(
            e,
            "it was computed with another init_adapter.adapter_model.safetensors"
        );
        // a store of the two-sequence layout (before the prefix tree) lacks the line
        let tree = format!("{KEY}pair_layout = prefix tree\n");
        let e = decode(&encode(KEY, &[1.0; 4]), &tree, 4).unwrap_err();
        assert_eq!(e, "it was computed with another pair_layout");
        let e = decode(&encode(KEY, &[1.0; 5]), KEY, 4).unwrap_err();
        assert_eq!(e, "it holds 5 values where this run has 4");
        let mut long = file();
        long.push(0);
        assert!(decode(&long, KEY, 4).unwrap_err().contains("after its end"));
    }

    #[test]
    fn a_flipped_bit_fails_the_checksum() {
        let mut b = file();
        let at = size(KEY, 0) as usize - SUM + 2; // inside the first value
        b[at] ^= 0x10;
        let e = decode(&b, KEY, 4).unwrap_err();
        assert!(e.contains("checksum"), "{e}");
        let mut b = file();
        b[3] ^= 1;
        assert!(decode(&b, KEY, 4).unwrap_err().contains("not a reference"));
    }
}

//! The pieces of a SentencePiece `tokenizer.model` (its `ModelProto` protobuf): each piece's
//! text, score and type, which is all llama.cpp's "llama" vocabulary takes from it.
//!
//! `ModelProto.pieces` is field 1 (repeated message); a piece is {1: piece (string),
//! 2: score (float), 3: type (enum: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
//! 6 byte; absent = normal)}. Other fields (trainer and normalizer specs) are skipped.

use std::fmt;

/// One vocabulary entry of a SentencePiece model.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Piece {
    /// The piece's text (`▁` for a space).
    pub(crate) text: String,
    pub(crate) score: f32,
    /// sentencepiece's type number (1 normal … 6 byte).
    pub(crate) kind: u32,
}

/// A malformed `tokenizer.model`: what was wrong and at which byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SpmError {
    pub(crate) at: usize,
    pub(crate) msg: &'static str,
}

impl fmt::Display for SpmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at byte {}", self.msg, self.at)
    }
}

/// A protobuf reader over one message's bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Where this message's bytes start in the file, for errors.
    base: usize,
}

impl<'a> Reader<'a> {
    fn err(&self, msg: &'static str) -> SpmError {
        SpmError {
            at: self.base + self.pos,
            msg,
        }
    }

    fn varint(&mut self) -> Result<u64, SpmError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *self
                .buf
                .get(self.pos)
                .ok_or_else(|| self.err("truncated varint"))?;
            self.pos += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint longer than 10 bytes"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], SpmError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err("field runs past the end"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// The next field: (number, wire type), or None at the end.
    fn key(&mut self) -> Result<Option<(u64, u8)>, SpmError> {
        if self.pos >= self.buf.len() {
            return Ok(None);
        }
        let k = self.varint()?;
        Ok(Some((k >> 3, (k & 7) as u8)))
    }

    /// A field's bytes (length-delimited), or the field skipped (other wire types).
    fn value(&mut self, wire: u8) -> Result<Value<'a>, SpmError> {
        Ok(match wire {
            0 => Value::Int(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed64
            }
            2 => {
                let n = self.varint()?;
                let n = usize::try_from(n).map_err(|_| self.err("length too large"))?;
                let start = self.base + self.pos;
                Value::Bytes(self.take(n)?, start)
            }
            5 => Value::Fixed32(self.take(4)?),
            _ => return Err(self.err("unknown wire type")),
        })
    }
}

/// A field's value, as far as the pieces need it.
enum Value<'a> {
    Int(u64),
    /// Skipped (no field of a piece is 64-bit).
    Fixed64,
    /// The bytes and where they start in the file.
    Bytes(&'a [u8], usize),
    Fixed32(&'a [u8]),
}

/// The pieces of a serialized `ModelProto`, in id order.
pub(crate) fn pieces(model: &[u8]) -> Result<Vec<Piece>, SpmError> {
    let mut r = Reader {
        buf: model,
        pos: 0,
        base: 0,
    };
    let mut out = Vec::new();
    while let Some((field, wire)) = r.key()? {
        let v = r.value(wire)?;
        if let (1, Value::Bytes(b, at)) = (field, v) {
            out.push(piece(b, at)?);
        }
    }
    if out.is_empty() {
        return Err(SpmError {
            at: 0,
            msg: "no pieces (not a SentencePiece model)",
        });
    }
    Ok(out)
}

fn piece(buf: &[u8], base: usize) -> Result<Piece, SpmError> {
    let mut r = Reader { buf, pos: 0, base };
    let mut p = Piece {
        text: String::new(),
        score: 0.0,
        kind: 1,
    };
    while let Some((field, wire)) = r.key()? {
        match (field, r.value(wire)?) {
            (1, Value::Bytes(b, _)) => {
                p.text = String::from_utf8(b.to_vec()).map_err(|_| r.err("piece is not UTF-8"))?
            }
            (2, Value::Fixed32(b)) => p.score = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            (3, Value::Int(t)) => p.kind = u32::try_from(t).map_err(|_| r.err("bad type"))?,
            _ => {}
        }
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-encoded model: two pieces (one with every field, one text-only) and a trainer
    /// spec field that is skipped.
    #[test]
    fn reads_pieces_and_skips_other_fields() {
        let mut m = Vec::new();
        // piece 1: {1: "<unk>", 2: -1.5f, 3: 2}
        let mut p = vec![0x0a, 5];
        p.extend_from_slice(b"<unk>");
        p.push(0x15);
        p.extend_from_slice(&(-1.5f32).to_le_bytes());
        p.extend_from_slice(&[0x18, 2]);
        m.push(0x0a);
        m.push(p.len() as u8);
        m.extend_from_slice(&p);
        // field 2 (trainer spec), skipped
        m.extend_from_slice(&[0x12, 2, 0x18, 2]);
        // piece 2: {1: "▁a"}
        let t = "▁a".as_bytes();
        m.extend_from_slice(&[0x0a, t.len() as u8 + 2, 0x0a, t.len() as u8]);
        m.extend_from_slice(t);
        let ps = pieces(&m).unwrap();
        assert_eq!(
            ps,
            [
                Piece {
                    text: "<unk>".into(),
                    score: -1.5,
                    kind: 2
                },
                Piece {
                    text: "▁a".into(),
                    score: 0.0,
                    kind: 1
                }
            ]
        );
        assert!(pieces(&m[..m.len() - 1]).is_err());
    }
}

//! TensorBoard's `Event` protobuf (tensorboard/compat/proto/event.proto), encoded and decoded by
//! hand for the fields a scalar log uses: wall_time (1, double), step (2, int64), and one of
//! file_version (3, string), summary (5: Summary { repeated Value value = 1 }, Value { tag = 1,
//! simple_value = 2 (float) }) or session_log (7: SessionLog { status = 1 }); source_metadata
//! (10: { writer = 1 }). Bytes as protobuf's own serializer writes them: fields in number
//! order, proto3 defaults (0, "") left out except inside a oneof.

/// One event as a scalar log writes and reads it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Event {
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    /// The training step the event belongs to.
    pub step: i64,
    /// The event's payload (the proto's `what` oneof).
    pub what: What,
    /// `source_metadata.writer`: the program that wrote the file (its first event carries it).
    pub writer: Option<String>,
}

/// The payload of an event.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum What {
    /// None of the oneof's fields.
    #[default]
    Empty,
    /// `file_version`: "brain.Event:2" in the first event of a file.
    FileVersion(String),
    /// `summary`: (tag, simple_value) pairs.
    Scalars(Vec<(String, f32)>),
    /// `session_log.status` (1 = START: TensorBoard drops what it holds at this step and later).
    SessionLog(i32),
    /// A payload this decoder does not read (graphs, images, tensors ...), by field number.
    Other(u32),
}

/// `SessionLog.status` START: a (re)started run.
pub(crate) const SESSION_START: i32 = 1;

/// The file_version string of TensorBoard's current event files.
pub(crate) const FILE_VERSION: &str = "brain.Event:2";

const VARINT: u8 = 0;
const I64: u8 = 1;
const LEN: u8 = 2;
const I32: u8 = 5;

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, ((field as u64) << 3) | wire as u64);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    key(out, field, LEN);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// The event's protobuf bytes.
pub fn encode(e: &Event) -> Vec<u8> {
    let mut out = Vec::new();
    if e.wall_time.to_bits() != 0 {
        key(&mut out, 1, I64);
        out.extend_from_slice(&e.wall_time.to_le_bytes());
    }
    if e.step != 0 {
        key(&mut out, 2, VARINT);
        varint(&mut out, e.step as u64);
    }
    match &e.what {
        What::Empty | What::Other(_) => {}
        What::FileVersion(v) => bytes_field(&mut out, 3, v.as_bytes()),
        What::Scalars(values) => {
            let mut summary = Vec::new();
            for (tag, v) in values {
                let mut value = Vec::new();
                if !tag.is_empty() {
                    bytes_field(&mut value, 1, tag.as_bytes());
                }
                key(&mut value, 2, I32);
                value.extend_from_slice(&v.to_le_bytes());
                bytes_field(&mut summary, 1, &value);
            }
            bytes_field(&mut out, 5, &summary);
        }
        What::SessionLog(status) => {
            let mut log = Vec::new();
            if *status != 0 {
                key(&mut log, 1, VARINT);
                varint(&mut log, *status as i64 as u64);
            }
            bytes_field(&mut out, 7, &log);
        }
    }
    if let Some(w) = &e.writer {
        let mut meta = Vec::new();
        if !w.is_empty() {
            bytes_field(&mut meta, 1, w.as_bytes());
        }
        bytes_field(&mut out, 10, &meta);
    }
    out
}

/// Why bytes are not an `Event`.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    /// The bytes end inside the field that starts at this offset (of its message).
    #[error("protobuf ends inside a field at byte {0}")]
    Truncated(usize),
    /// A group (wire types 3, 4) or an unknown wire type.
    #[error("protobuf wire type {wire} (field {field}) is not one this decoder reads")]
    WireType {
        /// The field's number.
        field: u32,
        /// Its wire type.
        wire: u8,
    },
    /// A string field (by number) that is not UTF-8.
    #[error("field {0} is not valid UTF-8")]
    Utf8(u32),
}

/// A field's value as read off the wire.
enum Val<'a> {
    Int(u64),
    Fixed64(u64),
    Fixed32(u32),
    Bytes(&'a [u8]),
}

/// The (field number, value) pairs of one message, in wire order.
fn fields(mut b: &[u8]) -> Result<Vec<(u32, Val<'_>)>, DecodeError> {
    let total = b.len();
    let mut out = Vec::new();
    while !b.is_empty() {
        let at = total - b.len();
        let k = read_varint(&mut b).ok_or(DecodeError::Truncated(at))?;
        let (field, wire) = ((k >> 3) as u32, (k & 7) as u8);
        let take = |b: &mut &[u8], n: usize| -> Result<u64, DecodeError> {
            if b.len() < n {
                return Err(DecodeError::Truncated(at));
            }
            let mut a = [0u8; 8];
            a[..n].copy_from_slice(&b[..n]);
            *b = &b[n..];
            Ok(u64::from_le_bytes(a))
        };
        let v = match wire {
            VARINT => Val::Int(read_varint(&mut b).ok_or(DecodeError::Truncated(at))?),
            I64 => Val::Fixed64(take(&mut b, 8)?),
            I32 => Val::Fixed32(take(&mut b, 4)? as u32),
            LEN => {
                let n = read_varint(&mut b).ok_or(DecodeError::Truncated(at))?;
                let n = usize::try_from(n)
                    .ok()
                    .filter(|&n| n <= b.len())
                    .ok_or(DecodeError::Truncated(at))?;
                let (data, rest) = b.split_at(n);
                b = rest;
                Val::Bytes(data)
            }
            _ => return Err(DecodeError::WireType { field, wire }),
        };
        out.push((field, v));
    }
    Ok(out)
}

fn read_varint(b: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&byte, rest) = b.split_first()?;
        *b = rest;
        v |= ((byte & 0x7F) as u64) << (7 * i);
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

fn text(field: u32, b: &[u8]) -> Result<String, DecodeError> {
    String::from_utf8(b.to_vec()).map_err(|_| DecodeError::Utf8(field))
}

/// An event read back from its protobuf bytes; fields this decoder does not know are skipped.
pub fn decode(b: &[u8]) -> Result<Event, DecodeError> {
    let mut e = Event::default();
    for (field, v) in fields(b)? {
        match (field, v) {
            (1, Val::Fixed64(x)) => e.wall_time = f64::from_bits(x),
            (2, Val::Int(x)) => e.step = x as i64,
            (3, Val::Bytes(s)) => e.what = What::FileVersion(text(3, s)?),
            (5, Val::Bytes(s)) => e.what = What::Scalars(summary(s)?),
            (7, Val::Bytes(s)) => {
                let mut status = 0;
                for (f, v) in fields(s)? {
                    if let (1, Val::Int(x)) = (f, v) {
                        status = x as i32;
                    }
                }
                e.what = What::SessionLog(status);
            }
            (10, Val::Bytes(s)) => {
                let mut writer = String::new();
                for (f, v) in fields(s)? {
                    if let (1, Val::Bytes(w)) = (f, v) {
                        writer = text(10, w)?;
                    }
                }
                e.writer = Some(writer);
            }
            (4 | 6 | 8 | 9, _) => e.what = What::Other(field),
            _ => {}
        }
    }
    Ok(e)
}

/// A Summary's (tag, simple_value) pairs; values of other kinds (images, tensors) are skipped.
fn summary(b: &[u8]) -> Result<Vec<(String, f32)>, DecodeError> {
    let mut out = Vec::new();
    for (f, v) in fields(b)? {
        let (1, Val::Bytes(value)) = (f, v) else {
            continue;
        };
        let (mut tag, mut simple) = (String::new(), None);
        for (f, v) in fields(value)? {
            match (f, v) {
                (1, Val::Bytes(t)) => tag = text(1, t)?,
                (2, Val::Fixed32(x)) => simple = Some(f32::from_bits(x)),
                _ => {}
            }
        }
        if let Some(x) = simple {
            out.push((tag, x));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip() {
        let cases = [
            Event {
                wall_time: 1.7e9 + 0.25,
                what: What::FileVersion(FILE_VERSION.into()),
                writer: Some("lora-train".into()),
                ..Event::default()
            },
            Event {
                wall_time: 3.5,
                step: 1 << 40,
                what: What::Scalars(vec![("a".into(), 0.0), ("x".repeat(200), -1.5)]),
                writer: None,
            },
            Event {
                what: What::SessionLog(SESSION_START),
                ..Event::default()
            },
        ];
        for e in cases {
            assert_eq!(decode(&encode(&e)).unwrap(), e);
        }
        // a zero value inside the oneof is written; the defaults outside it are not
        let e = Event {
            what: What::Scalars(vec![(String::new(), 0.0)]),
            ..Event::default()
        };
        assert_eq!(encode(&e), [0x2a, 0x07, 0x0a, 0x05, 0x15, 0, 0, 0, 0]);
        assert_eq!(decode(&[0x2a, 0x07, 0x0a]), Err(DecodeError::Truncated(0)));
        assert_eq!(
            decode(&[0x0b]),
            Err(DecodeError::WireType { field: 1, wire: 3 })
        );
    }
}

//! The frames that process ranks exchange over TCP (`parallel::tcp`), and tensors as bytes.
//!
//! defines: Frame (Hello, Welcome, Data, Abort, Bye), Op, read / write of a frame,
//! tensor_bytes / tensor_from.
//!
//! Every frame starts with `MAGIC` and a kind byte; numbers are little-endian. A Data frame
//! carries one rank's part of collective number `seq` (or rank 0's result of it): the op, its
//! argument (broadcast's root), and a tensor as dtype, dims and raw bytes, exactly the bits
//! the rank holds. Every length read from the socket is bounded before it sizes a buffer.

use candle_core::{DType, Device, Tensor};
use std::io::{self, Read, Write};

/// "LTRC": the first bytes of every frame; anything else on the port is not a lora-train rank.
pub const MAGIC: u32 = 0x4352_544c;
/// The protocol's version: ranks of two builds that frame differently refuse each other.
pub const VERSION: u32 = 1;
/// The most dimensions a tensor of a frame may have.
const MAX_DIMS: usize = 8;
/// The largest tensor a frame may carry (64 GiB): a bound on what a corrupt length allocates.
const MAX_BYTES: u64 = 64 << 30;
/// The longest error text an Abort frame may carry.
const MAX_WHY: usize = 1 << 16;

/// A collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Σ over ranks.
    AllReduce,
    /// Every rank's part, rank order.
    AllGather,
    /// The root's (`arg`) tensor.
    Broadcast,
    /// Nothing: every rank arrived.
    Barrier,
}

impl Op {
    /// The name errors use (the thread ranks' names).
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
        }
    }

    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(c: u8) -> io::Result<Op> {
        [Op::AllReduce, Op::AllGather, Op::Broadcast, Op::Barrier]
            .get(c as usize)
            .copied()
            .ok_or_else(|| bad(format!("unknown collective {c}")))
    }
}

/// A tensor on the wire: dtype, dims, its bytes in memory order.
#[derive(Debug, Clone, PartialEq)]
pub struct Wire {
    /// The element type.
    pub dtype: DType,
    /// The shape.
    pub dims: Vec<usize>,
    /// The elements' bytes, row-major, little-endian.
    pub bytes: Vec<u8>,
}

/// One message between two ranks.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// A rank's first words to rank 0: who it is and how many ranks it was told there are.
    Hello {
        /// `VERSION` of the sender's build.
        version: u32,
        /// The sender's rank.
        rank: u32,
        /// The world size the sender was started with.
        world: u32,
    },
    /// Rank 0's answer once every rank has said hello: the group is complete.
    Welcome {
        /// The world size.
        world: u32,
    },
    /// A rank's part of collective `seq` (to rank 0), or its result (from rank 0). No tensor:
    /// a barrier, or a broadcast's non-root part.
    Data {
        /// The collective's number: every rank counts its collectives from 0.
        seq: u64,
        /// Which collective.
        op: Op,
        /// Its argument: a broadcast's root, else 0.
        arg: u32,
        /// The part or the result, if any.
        tensor: Option<Wire>,
    },
    /// Rank `rank` failed with `why` (from the rank itself, or forwarded by rank 0).
    Abort {
        /// The rank that failed.
        rank: u32,
        /// Its error chain.
        why: String,
    },
    /// The sender finished its run: it joins no further collective.
    Bye,
}

const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const DATA: u8 = 3;
const ABORT: u8 = 4;
const BYE: u8 = 5;
/// The dtype byte of a Data frame without a tensor.
const NO_TENSOR: u8 = 0xff;

fn bad(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// The dtypes a frame carries, by code.
const DTYPES: [DType; 9] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

fn dtype_code(d: DType) -> io::Result<u8> {
    DTYPES
        .iter()
        .position(|x| *x == d)
        .map(|i| i as u8)
        .ok_or_else(|| bad(format!("the TCP communicator carries no {d:?} tensors")))
}

/// `t`'s elements as their bytes, in row-major order (a copy; any device).
pub fn tensor_bytes(t: &Tensor) -> candle_core::Result<Vec<u8>> {
    let t = t.flatten_all()?;
    fn raw<T: bytemuck::Pod + candle_core::WithDType>(t: &Tensor) -> candle_core::Result<Vec<u8>> {
        Ok(bytemuck::cast_slice(&t.to_vec1::<T>()?).to_vec())
    }
    match t.dtype() {
        DType::U8 => t.to_vec1::<u8>(),
        DType::U32 => raw::<u32>(&t),
        DType::I16 => raw::<i16>(&t),
        DType::I32 => raw::<i32>(&t),
        DType::I64 => raw::<i64>(&t),
        DType::BF16 => raw::<half::bf16>(&t),
        DType::F16 => raw::<half::f16>(&t),
        DType::F32 => raw::<f32>(&t),
        DType::F64 => raw::<f64>(&t),
        d => Err(candle_core::Error::Msg(format!(
            "the TCP communicator carries no {d:?} tensors"
        ))),
    }
}

impl Wire {
    /// `t` as it goes on the wire.
    pub fn of(t: &Tensor) -> candle_core::Result<Wire> {
        Ok(Wire {
            dtype: t.dtype(),
            dims: t.dims().to_vec(),
            bytes: tensor_bytes(t)?,
        })
    }

    /// The tensor again, on `dev`, with the very bits it was sent with.
    pub fn tensor(&self, dev: &Device) -> candle_core::Result<Tensor> {
        Tensor::from_raw_buffer(&self.bytes, self.dtype, &self.dims, dev)
    }
}

fn u8_(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn u32_(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn u64_(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// `n` bytes from `r`, `n` bounded by `max` before anything is allocated.
fn bytes_(r: &mut impl Read, n: u64, max: u64, what: &str) -> io::Result<Vec<u8>> {
    if n > max {
        return Err(bad(format!("{what} of {n} bytes (at most {max})")));
    }
    let mut buf = vec![0u8; n as usize];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// The next frame from `r`. `Ok(None)`: the peer closed the connection between frames.
pub fn read(r: &mut impl Read) -> io::Result<Option<Frame>> {
    let mut m = [0u8; 4];
    loop {
        match r.read(&mut m[..1]) {
            Ok(0) => return Ok(None),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    r.read_exact(&mut m[1..])?;
    if u32::from_le_bytes(m) != MAGIC {
        return Err(bad("not a lora-train rank's frame".into()));
    }
    Ok(Some(match u8_(r)? {
        HELLO => Frame::Hello {
            version: u32_(r)?,
            rank: u32_(r)?,
            world: u32_(r)?,
        },
        WELCOME => Frame::Welcome { world: u32_(r)? },
        DATA => read_data(r)?,
        ABORT => {
            let rank = u32_(r)?;
            let n = u32_(r)? as u64;
            let why = bytes_(r, n, MAX_WHY as u64, "an error text")?;
            Frame::Abort {
                rank,
                why: String::from_utf8_lossy(&why).into_owned(),
            }
        }
        BYE => Frame::Bye,
        k => return Err(bad(format!("unknown frame kind {k}"))),
    }))
}

fn read_data(r: &mut impl Read) -> io::Result<Frame> {
    let seq = u64_(r)?;
    let op = Op::from_code(u8_(r)?)?;
    let arg = u32_(r)?;
    let code = u8_(r)?;
    if code == NO_TENSOR {
        return Ok(Frame::Data {
            seq,
            op,
            arg,
            tensor: None,
        });
    }
    let dtype = *DTYPES
        .get(code as usize)
        .ok_or_else(|| bad(format!("unknown dtype {code}")))?;
    let ndims = u8_(r)? as usize;
    if ndims > MAX_DIMS {
        return Err(bad(format!(
            "a tensor of {ndims} dims (at most {MAX_DIMS})"
        )));
    }
    let mut dims = Vec::with_capacity(ndims);
    let mut elems: u64 = 1;
    for _ in 0..ndims {
        let d = u64_(r)?;
        elems = elems
            .checked_mul(d)
            .filter(|&e| e <= MAX_BYTES)
            .ok_or_else(|| bad("a tensor's dims overflow".into()))?;
        dims.push(d as usize);
    }
    let n = u64_(r)?;
    let want = elems * dtype.size_in_bytes() as u64;
    if n != want {
        return Err(bad(format!(
            "a {dtype:?} tensor of dims {dims:?} with {n} bytes (want {want})"
        )));
    }
    let bytes = bytes_(r, n, MAX_BYTES, "a tensor")?;
    Ok(Frame::Data {
        seq,
        op,
        arg,
        tensor: Some(Wire { dtype, dims, bytes }),
    })
}

/// `f` written to `w` whole (the caller holds `w` for the frame: frames never interleave).
pub fn write(w: &mut impl Write, f: &Frame) -> io::Result<()> {
    let mut head = MAGIC.to_le_bytes().to_vec();
    let mut tail: &[u8] = &[];
    match f {
        Frame::Hello {
            version,
            rank,
            world,
        } => {
            head.push(HELLO);
            for x in [version, rank, world] {
                head.extend(x.to_le_bytes());
            }
        }
        Frame::Welcome { world } => {
            head.push(WELCOME);
            head.extend(world.to_le_bytes());
        }
        Frame::Data {
            seq,
            op,
            arg,
            tensor,
        } => {
            head.push(DATA);
            head.extend(seq.to_le_bytes());
            head.push(op.code());
            head.extend(arg.to_le_bytes());
            match tensor {
                None => head.push(NO_TENSOR),
                Some(t) => {
                    head.push(dtype_code(t.dtype)?);
                    head.push(t.dims.len() as u8);
                    for d in &t.dims {
                        head.extend((*d as u64).to_le_bytes());
                    }
                    head.extend((t.bytes.len() as u64).to_le_bytes());
                    tail = &t.bytes;
                }
            }
        }
        Frame::Abort { rank, why } => {
            head.push(ABORT);
            head.extend(rank.to_le_bytes());
            // Cut at a char boundary within the bound the reader enforces.
            let mut end = why.len().min(MAX_WHY);
            while !why.is_char_boundary(end) {
                end -= 1;
            }
            head.extend((end as u32).to_le_bytes());
            head.extend(&why.as_bytes()[..end]);
        }
        Frame::Bye => head.push(BYE),
    }
    w.write_all(&head)?;
    w.write_all(tail)?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_and_tensors_round_trip_to_the_bit() {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[1.5f32, -0.0], [f32::MIN_POSITIVE, 3.25e-7]], &dev).unwrap();
        let tensors = [
            x.clone(),
            x.to_dtype(DType::BF16).unwrap(),
            x.to_dtype(DType::F64).unwrap(),
            Tensor::new(&[7u8, 0, 255], &dev).unwrap(),
        ];
        for t in &tensors {
            let f = Frame::Data {
                seq: 9,
                op: Op::Broadcast,
                arg: 2,
                tensor: Some(Wire::of(t).unwrap()),
            };
            let mut buf = Vec::new();
            write(&mut buf, &f).unwrap();
            let back = read(&mut buf.as_slice()).unwrap().unwrap();
            assert_eq!(back, f);
            let Frame::Data {
                tensor: Some(w), ..
            } = back
            else {
                unreachable!()
            };
            let y = w.tensor(&dev).unwrap();
            assert_eq!((y.dtype(), y.dims()), (t.dtype(), t.dims()));
            assert_eq!(tensor_bytes(&y).unwrap(), tensor_bytes(t).unwrap());
        }
        for f in [
            Frame::Hello {
                version: VERSION,
                rank: 3,
                world: 4,
            },
            Frame::Welcome { world: 4 },
            Frame::Abort {
                rank: 1,
                why: "train.jsonl:5: bad row".into(),
            },
            Frame::Bye,
        ] {
            let mut buf = Vec::new();
            write(&mut buf, &f).unwrap();
            assert_eq!(read(&mut buf.as_slice()).unwrap(), Some(f));
        }
        assert_eq!(read(&mut [].as_slice()).unwrap(), None);
    }

    #[test]
    fn a_corrupt_length_is_refused_before_it_allocates() {
        let f = Frame::Data {
            seq: 1,
            op: Op::AllReduce,
            arg: 0,
            tensor: Some(Wire::of(&Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap()).unwrap()),
        };
        let mut buf = Vec::new();
        write(&mut buf, &f).unwrap();
        // The byte count (8 bytes before the payload's 8) claims 2^62 bytes.
        let at = buf.len() - 16;
        buf[at..at + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let e = read(&mut buf.as_slice()).unwrap_err();
        assert!(
            e.to_string()
                .contains("with 4611686018427387904 bytes (want 8)"),
            "{e}"
        );
        let e = read(&mut b"GET / HTTP/1.1\r\n".as_slice()).unwrap_err();
        assert_eq!(e.to_string(), "not a lora-train rank's frame");
    }
}

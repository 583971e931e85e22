//! TFRecord framing, as TensorBoard's event files use it: each record is its length (u64
//! little-endian), the masked CRC-32C of those 8 bytes (u32 LE), the data, and the masked
//! CRC-32C of the data (u32 LE). Defines the CRC-32C (Castagnoli, table-driven), its mask,
//! one record's bytes, and a reader that checks both CRCs.

/// CRC-32C's polynomial, bit-reversed (the reflected form the table uses).
const POLY: u32 = 0x82F6_3B78;

/// The CRC-32C of every byte value: one table lookup per byte of input.
const TABLE: [u32; 256] = table();

const fn table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

/// CRC-32C (Castagnoli) of `bytes`: initial value and final xor 0xFFFFFFFF, reflected.
pub(crate) fn crc32c(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c = TABLE[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8);
    }
    !c
}

/// TensorFlow's masked CRC: rotated right by 15 bits plus a constant, so that a CRC stored
/// inside checksummed data does not checksum to a fixed value.
pub(crate) fn masked_crc32c(bytes: &[u8]) -> u32 {
    let c = crc32c(bytes);
    c.rotate_right(15).wrapping_add(0xA282_EAD8)
}

/// `data` framed as one TFRecord, appended to `out`.
pub fn push_record(out: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
}

/// Why a file is not a sequence of intact TFRecords.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RecordError {
    /// The file ends inside the record that starts at byte `at`.
    #[error("record at byte {at}: the file ends inside it (truncated)")]
    Truncated {
        /// Where the record starts.
        at: usize,
    },
    /// The record at byte `at` has a length whose CRC does not match.
    #[error("record at byte {at}: the CRC of its length does not match (corrupt)")]
    LengthCrc {
        /// Where the record starts.
        at: usize,
    },
    /// The record at byte `at` has data whose CRC does not match.
    #[error("record at byte {at}: the CRC of its data does not match (corrupt)")]
    DataCrc {
        /// Where the record starts.
        at: usize,
    },
}

/// The records of `bytes`, each checked against both CRCs. A length is trusted only after its
/// CRC matches and only up to the bytes left in the file.
pub fn read_records(bytes: &[u8]) -> Result<Vec<&[u8]>, RecordError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < 12 {
            return Err(RecordError::Truncated { at });
        }
        let (len_bytes, rest) = rest.split_at(8);
        let (crc, rest) = rest.split_at(4);
        if masked_crc32c(len_bytes) != le_u32(crc) {
            return Err(RecordError::LengthCrc { at });
        }
        let mut len8 = [0u8; 8];
        len8.copy_from_slice(len_bytes);
        let len = u64::from_le_bytes(len8);
        let len = match usize::try_from(len) {
            Ok(n) if n.checked_add(4).is_some_and(|m| m <= rest.len()) => n,
            _ => return Err(RecordError::Truncated { at }),
        };
        let (data, rest) = rest.split_at(len);
        if masked_crc32c(data) != le_u32(&rest[..4]) {
            return Err(RecordError::DataCrc { at });
        }
        out.push(data);
        at += 16 + len;
    }
    Ok(out)
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_values() {
        // RFC 3720 (iSCSI) B.4 and the catalogue's check value of "123456789".
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let inc: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&inc), 0x46DD_794E);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn records_round_trip_and_damage_is_named() {
        let mut f = Vec::new();
        push_record(&mut f, b"first");
        push_record(&mut f, b"");
        push_record(&mut f, &[7u8; 300]);
        let recs = read_records(&f).unwrap();
        assert_eq!(recs, vec![&b"first"[..], &b""[..], &[7u8; 300][..]]);
        let second = 16 + 5;
        assert_eq!(
            read_records(&f[..second + 16]),
            Ok(vec![&b"first"[..], &b""[..]])
        );
        let mut bad = f.clone();
        bad[3] ^= 1;
        assert_eq!(read_records(&bad), Err(RecordError::LengthCrc { at: 0 }));
        let mut bad = f.clone();
        bad[12] ^= 1;
        assert_eq!(read_records(&bad), Err(RecordError::DataCrc { at: 0 }));
        assert_eq!(
            read_records(&f[..f.len() - 1]),
            Err(RecordError::Truncated { at: second + 16 })
        );
    }
}

//! Parquet files (the Hub's data set format) read one row group at a time, only the columns a
//! format reads, through the crate's record API: nested lists and structs (chat messages,
//! ShareGPT turns) come out as [`Field`] lists and objects in schema order. The file itself is
//! never held in memory: the footer, then each row group's pages as its rows are read.

use super::reader::{Loc, Sink};
use super::record::Field;
use anyhow::{bail, Context, Result};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field as PField;
use parquet::schema::types::Type;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A column a format reads: the names it may have (the first one present is read), and
/// whether a file must have it.
pub struct Want<'a> {
    pub(crate) names: Vec<&'a str>,
    pub(crate) required: bool,
}

/// Calls `sink` with every row (1-based) of the parquet file `path`, projected on `want`
/// (every column when it is empty).
/// A file without a required column is an error naming the columns it has and the fix.
/// Each row group's compressed bytes are added to `read` once its rows are read.
pub fn read(
    path: &Path,
    name: &str,
    want: &[Want],
    read: &AtomicU64,
    sink: &mut Sink,
) -> Result<()> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot open {name}"))?;
    let reader = SerializedFileReader::new(file)
        .with_context(|| format!("{name} is not a readable parquet file"))?;
    let projection = projection(reader.metadata().file_metadata().schema(), name, want)?;
    let mut row = 0usize;
    for g in 0..reader.num_row_groups() {
        let group = reader
            .get_row_group(g)
            .with_context(|| format!("{name}: cannot read row group {g}"))?;
        let rows = group
            .get_row_iter(projection.clone())
            .with_context(|| format!("{name}: cannot read row group {g}"))?;
        for r in rows {
            row += 1;
            let r =
                r.with_context(|| format!("{name}: row {row} (row group {g}) cannot be decoded"))?;
            let rec = r
                .get_column_iter()
                .map(|(k, v)| {
                    convert(v)
                        .map(|f| (k.clone(), f))
                        .map_err(|e| anyhow::anyhow!("column \"{k}\": {e}"))
                })
                .collect::<Result<Vec<_>>>()
                .map(Field::map);
            sink(Loc::Row(row), rec)?;
        }
        let size = reader.metadata().row_group(g).compressed_size();
        read.fetch_add(size.max(0) as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// The columns of `schema` (file `name`) that `want` reads, as a projection: the first name
/// of each that the file has; None (every column) when `want` is empty. A required column
/// the file lacks is an error naming the columns it has and the fix.
fn projection(schema: &Type, name: &str, want: &[Want]) -> Result<Option<Type>> {
    if want.is_empty() {
        return Ok(None);
    }
    let fields = schema.get_fields();
    let mut picked: Vec<Arc<Type>> = Vec::new();
    for w in want {
        match w
            .names
            .iter()
            .find_map(|n| fields.iter().find(|f| f.name() == *n))
        {
            Some(f) => picked.push(f.clone()),
            None if !w.required => {}
            None => {
                let have: Vec<&str> = fields.iter().map(|f| f.name()).collect();
                bail!(
                    "{name} has no column \"{}\" (its columns: {}): name the column that holds it \
                     with data.columns, e.g. columns = {{ {} = \"{}\" }}",
                    w.names.join("\" or \""),
                    have.join(", "),
                    w.names[0],
                    have.first().copied().unwrap_or("...")
                )
            }
        }
    }
    let projection = Type::group_type_builder(schema.name())
        .with_fields(picked)
        .build()
        .with_context(|| format!("{name}: cannot select its columns"))?;
    Ok(Some(projection))
}

/// A parquet value as a [`Field`]: integers, floats, strings, lists, structs and string-keyed
/// maps; dates, times and decimals as their text. Binary values must be UTF-8.
fn convert(v: &PField) -> Result<Field, String> {
    Ok(match v {
        PField::Null => Field::Null,
        PField::Bool(b) => Field::Bool(*b),
        PField::Byte(x) => Field::Int(*x as i64),
        PField::Short(x) => Field::Int(*x as i64),
        PField::Int(x) => Field::Int(*x as i64),
        PField::Long(x) => Field::Int(*x),
        PField::UByte(x) => Field::Int(*x as i64),
        PField::UShort(x) => Field::Int(*x as i64),
        PField::UInt(x) => Field::Int(*x as i64),
        PField::ULong(x) => i64::try_from(*x).map_or(Field::Float(*x as f64), Field::Int),
        PField::Float16(x) => Field::Float(f64::from(*x)),
        PField::Float(x) => Field::Float(*x as f64),
        PField::Double(x) => Field::Float(*x),
        PField::Str(s) => Field::Str(s.clone()),
        PField::Bytes(b) => match std::str::from_utf8(b.data()) {
            Ok(s) => Field::Str(s.to_string()),
            Err(_) => return Err("a binary value is not UTF-8 text".into()),
        },
        PField::Group(r) => Field::map(
            r.get_column_iter()
                .map(|(k, v)| Ok((k.clone(), convert(v)?)))
                .collect::<Result<Vec<_>, String>>()?,
        ),
        PField::ListInternal(l) => {
            Field::List(l.elements().iter().map(convert).collect::<Result<_, _>>()?)
        }
        PField::MapInternal(m) => {
            let mut pairs = Vec::with_capacity(m.entries().len());
            for (k, v) in m.entries() {
                let Field::Str(k) = convert(k)? else {
                    return Err("a map column has keys that are not strings".into());
                };
                pairs.push((k, convert(v)?));
            }
            Field::map(pairs)
        }
        other => Field::Str(other.to_string()),
    })
}

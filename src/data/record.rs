//! One data set row as read from jsonl, json or parquet: a tree of values whose objects keep
//! their keys in file (or schema) order, as chat templates see them.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use std::fmt;

/// A value of a row: JSON's types, with objects in key order.
#[derive(Debug, Clone, PartialEq)]
pub enum Field {
    /// JSON null (a parquet null).
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A floating-point number.
    Float(f64),
    /// A string.
    Str(String),
    /// An array (a parquet list).
    List(Vec<Field>),
    /// Keys in order; a key appears once (a repeated JSON key keeps its last value, as
    /// Python's json does).
    Map(Vec<(String, Field)>),
}

impl Field {
    /// The value of `key` when this is an object.
    pub(crate) fn get(&self, key: &str) -> Option<&Field> {
        match self {
            Field::Map(m) => m.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// What the value is, for messages: "a string", "null", "a list", ...
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Field::Null => "null",
            Field::Bool(_) => "a boolean",
            Field::Int(_) => "an integer",
            Field::Float(_) => "a number",
            Field::Str(_) => "a string",
            Field::List(_) => "a list",
            Field::Map(_) => "an object",
        }
    }

    /// Calls `f` on every string in the tree.
    pub(crate) fn any_str(&self, f: &dyn Fn(&str) -> bool) -> bool {
        match self {
            Field::Str(s) => f(s),
            Field::List(v) => v.iter().any(|x| x.any_str(f)),
            Field::Map(m) => m.iter().any(|(k, v)| f(k) || v.any_str(f)),
            _ => false,
        }
    }

    /// The value as a template sees it (objects in key order), as minijinja reads JSON.
    pub(crate) fn to_value(&self) -> minijinja::Value {
        use minijinja::Value;
        match self {
            Field::Null => Value::from(()),
            Field::Bool(b) => Value::from(*b),
            Field::Int(x) => Value::from(*x),
            Field::Float(x) => Value::from(*x),
            Field::Str(s) => Value::from(s.as_str()),
            Field::List(v) => Value::from(v.iter().map(Field::to_value).collect::<Vec<_>>()),
            Field::Map(m) => Value::from_pairs(m.iter().map(|(k, v)| (k.as_str(), v.to_value()))),
        }
    }

    /// The longest string value in the tree, in bytes.
    pub fn longest_str(&self) -> usize {
        match self {
            Field::Str(s) => s.len(),
            Field::List(v) => v.iter().map(Field::longest_str).max().unwrap_or(0),
            Field::Map(m) => m.iter().map(|(_, v)| v.longest_str()).max().unwrap_or(0),
            _ => 0,
        }
    }

    /// Bytes of the string values in the tree (what a row weighs in memory, roughly).
    pub fn text_bytes(&self) -> usize {
        match self {
            Field::Str(s) => s.len(),
            Field::List(v) => v.iter().map(Field::text_bytes).sum(),
            Field::Map(m) => m.iter().map(|(k, v)| k.len() + v.text_bytes()).sum(),
            _ => 0,
        }
    }

    /// A copy with every string value cut to at most `max` bytes (at a character boundary).
    pub fn cut_copy(&self, max: usize) -> Field {
        match self {
            Field::Str(s) => Field::Str(s[..floor_char_boundary(s, max)].to_string()),
            Field::List(v) => Field::List(v.iter().map(|x| x.cut_copy(max)).collect()),
            Field::Map(m) => Field::Map(
                m.iter()
                    .map(|(k, v)| (k.clone(), v.cut_copy(max)))
                    .collect(),
            ),
            x => x.clone(),
        }
    }

    /// Cuts every string value to at most `max` bytes (at a character boundary), in place.
    pub fn cut(&mut self, max: usize) {
        match self {
            Field::Str(s) => {
                let n = floor_char_boundary(s, max);
                s.truncate(n);
                if s.capacity() > 2 * n.max(16) {
                    s.shrink_to_fit();
                }
            }
            Field::List(v) => v.iter_mut().for_each(|x| x.cut(max)),
            Field::Map(m) => m.iter_mut().for_each(|(_, v)| v.cut(max)),
            _ => {}
        }
    }

    /// An object from ordered pairs, a later repeat of a key replacing the earlier value.
    pub(crate) fn map(pairs: impl IntoIterator<Item = (String, Field)>) -> Field {
        let mut m: Vec<(String, Field)> = Vec::new();
        for (k, v) in pairs {
            match m.iter_mut().find(|(key, _)| *key == k) {
                Some(slot) => slot.1 = v,
                None => m.push((k, v)),
            }
        }
        Field::Map(m)
    }
}

/// The largest n <= max at which `s` can be cut (a character boundary).
fn floor_char_boundary(s: &str, max: usize) -> usize {
    if max >= s.len() {
        return s.len();
    }
    (0..=max)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0)
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Field, D::Error> {
        d.deserialize_any(FieldVisitor)
    }
}

struct FieldVisitor;

impl<'de> Visitor<'de> for FieldVisitor {
    type Value = Field;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Field, E> {
        Ok(Field::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Field, E> {
        Ok(Field::Null)
    }
    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Field, E> {
        Ok(Field::Bool(b))
    }
    fn visit_i64<E: de::Error>(self, x: i64) -> Result<Field, E> {
        Ok(Field::Int(x))
    }
    fn visit_u64<E: de::Error>(self, x: u64) -> Result<Field, E> {
        Ok(i64::try_from(x).map_or(Field::Float(x as f64), Field::Int))
    }
    fn visit_f64<E: de::Error>(self, x: f64) -> Result<Field, E> {
        Ok(Field::Float(x))
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Field, E> {
        Ok(Field::Str(s.to_string()))
    }
    fn visit_string<E: de::Error>(self, s: String) -> Result<Field, E> {
        Ok(Field::Str(s))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Field, A::Error> {
        let mut v = Vec::new();
        while let Some(x) = a.next_element()? {
            v.push(x);
        }
        Ok(Field::List(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Field, A::Error> {
        let mut pairs = Vec::new();
        while let Some((k, v)) = a.next_entry::<String, Field>()? {
            pairs.push((k, v));
        }
        Ok(Field::map(pairs))
    }
}

impl Serialize for Field {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Field::Null => s.serialize_unit(),
            Field::Bool(b) => s.serialize_bool(*b),
            Field::Int(x) => s.serialize_i64(*x),
            Field::Float(x) => s.serialize_f64(*x),
            Field::Str(x) => s.serialize_str(x),
            Field::List(v) => {
                let mut seq = s.serialize_seq(Some(v.len()))?;
                for x in v {
                    seq.serialize_element(x)?;
                }
                seq.end()
            }
            Field::Map(m) => {
                let mut map = s.serialize_map(Some(m.len()))?;
                for (k, v) in m {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_keep_their_key_order_through_json_and_templates() {
        let f: Field =
            serde_json::from_str(r#"{"z": 1, "a": [true, null, 2.5], "m": "x", "z": 3}"#).unwrap();
        let Field::Map(m) = &f else { panic!() };
        let keys: Vec<&str> = m.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["z", "a", "m"]);
        assert_eq!(f.get("z"), Some(&Field::Int(3)));
        assert_eq!(
            serde_json::to_string(&f).unwrap(),
            r#"{"z":3,"a":[true,null,2.5],"m":"x"}"#
        );
        let v = f.to_value();
        let env = minijinja::Environment::new();
        let out = env
            .render_str(
                "{% for k in v %}{{ k }} {% endfor %}{{ v.a[2] }}",
                minijinja::context! { v },
            )
            .unwrap();
        assert_eq!(out, "z a m 2.5");
    }

    #[test]
    fn strings_are_cut_at_character_boundaries() {
        let f: Field =
            serde_json::from_str(r#"{"a": "héllo wörld", "b": [{"c": "xyz"}, 7], "d": "ab"}"#)
                .unwrap();
        assert_eq!(f.longest_str(), 13);
        assert_eq!(f.text_bytes(), 13 + 3 + 2 + 4);
        // "hé" is 3 bytes: a cut at 2 falls inside "é" and backs off to "h".
        let c = f.cut_copy(2);
        assert_eq!(c.get("a"), Some(&Field::Str("h".into())));
        assert_eq!(c.get("d"), Some(&Field::Str("ab".into())));
        let Some(Field::List(b)) = c.get("b") else {
            panic!()
        };
        assert_eq!(b[0].get("c"), Some(&Field::Str("xy".into())));
        assert_eq!(b[1], Field::Int(7));
        let mut g = f.clone();
        g.cut(3);
        assert_eq!(g, f.cut_copy(3));
        assert_eq!(f.cut_copy(100), f);
    }
}

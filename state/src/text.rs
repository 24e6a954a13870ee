//! [`ShortText`]: a string kept inline when short, for a node's UID and boot ID.
//!
//! Both are UUIDs in canonical form (36 bytes) on any real cluster. As `String`s they cost two
//! heap allocations per node: 130,000 at 65,000 nodes, every time a list is parsed or the
//! checkpoint decoded, and about 100 bytes of heap per node. Inline, up to 38 bytes cost
//! nothing beyond the record itself; anything longer (a hand-written NodeList may say anything)
//! goes to the heap as before. It reads as a `&str` everywhere and serializes as a string.

use std::fmt;
use std::ops::Deref;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The longest text kept inline: a canonical UUID (36 bytes) and a little room.
const INLINE: usize = 38;

/// A string, inline up to 38 bytes.
#[derive(Clone)]
pub struct ShortText(Repr);

#[derive(Clone)]
enum Repr {
    /// `bytes[..len]` is valid UTF-8.
    Inline {
        len: u8,
        bytes: [u8; INLINE],
    },
    Heap(Box<str>),
}

impl ShortText {
    pub fn new(s: &str) -> Self {
        match s.len() {
            len @ 0..=INLINE => {
                let mut bytes = [0; INLINE];
                bytes[..len].copy_from_slice(s.as_bytes());
                Self(Repr::Inline {
                    len: len as u8,
                    bytes,
                })
            }
            _ => Self(Repr::Heap(s.into())),
        }
    }

    pub fn as_str(&self) -> &str {
        match &self.0 {
            Repr::Inline { len, bytes } => {
                // SAFETY: `new` copied exactly `len` bytes of a `str` there, so they are valid
                // UTF-8 and `len` is within the array.
                unsafe { std::str::from_utf8_unchecked(bytes.get_unchecked(..usize::from(*len))) }
            }
            Repr::Heap(s) => s,
        }
    }
}

impl Default for ShortText {
    fn default() -> Self {
        Self::new("")
    }
}

impl Deref for ShortText {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl From<&str> for ShortText {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

impl From<String> for ShortText {
    fn from(s: String) -> Self {
        match s.len() {
            0..=INLINE => Self::new(&s),
            _ => Self(Repr::Heap(s.into_boxed_str())),
        }
    }
}

impl PartialEq for ShortText {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for ShortText {}

impl PartialEq<str> for ShortText {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for ShortText {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl fmt::Debug for ShortText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for ShortText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ShortText {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ShortText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ShortText;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ShortText, E> {
                Ok(ShortText::new(s))
            }

            fn visit_string<E: serde::de::Error>(self, s: String) -> Result<ShortText, E> {
                Ok(s.into())
            }
        }
        d.deserialize_str(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_text_is_the_text_inline_or_not() {
        let uuid = "0f8fad5b-d9cb-469f-a165-70867728950e";
        for s in [
            "",
            "uid-1",
            uuid,
            &format!("{uuid}-and-more-than-fits-inline"),
        ] {
            let t = ShortText::from(s);
            assert_eq!(t, s);
            assert_eq!(t.as_str(), s);
            assert_eq!(ShortText::from(s.to_string()), t);
            assert_eq!(format!("{t}"), s);
            assert_eq!(format!("{t:?}"), format!("{s:?}"));
            let json = serde_json::to_string(&t).unwrap();
            assert_eq!(json, serde_json::to_string(s).unwrap());
            assert_eq!(serde_json::from_str::<ShortText>(&json).unwrap(), t);
        }
        assert!(matches!(ShortText::from(uuid).0, Repr::Inline { .. }));
        assert_eq!(std::mem::size_of::<ShortText>(), 40);
    }
}

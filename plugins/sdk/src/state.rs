//! Little-endian encoding helpers for [`State`] bytes, so a policy can hand its state to
//! a new version of itself at a hot swap without pulling a serialisation crate into the
//! plugin.

use crate::State;

impl State {
    /// No state: schema version 0 and no bytes. What [`Policy::snapshot`](crate::Policy)
    /// returns by default.
    pub fn empty() -> Self {
        State {
            schema_version: 0,
            bytes: Vec::new(),
        }
    }

    /// True for [`State::empty`].
    pub fn is_empty(&self) -> bool {
        self.schema_version == 0 && self.bytes.is_empty()
    }
}

/// Builds the bytes of a [`State`], little-endian.
///
/// ```
/// use tokwatt_policy_sdk::{StateReader, StateWriter};
///
/// let state = StateWriter::new().u32(2).f64(450.0).bool(true).finish(1);
/// assert_eq!(state.schema_version, 1);
/// let mut reader = StateReader::new(&state.bytes);
/// assert_eq!(reader.u32(), Ok(2));
/// assert_eq!(reader.f64(), Ok(450.0));
/// assert_eq!(reader.bool(), Ok(true));
/// assert_eq!(reader.finish(), Ok(()));
/// ```
#[derive(Debug, Clone, Default)]
pub struct StateWriter {
    bytes: Vec<u8>,
}

impl StateWriter {
    /// An empty writer.
    pub fn new() -> Self {
        StateWriter::default()
    }

    /// Appends one byte.
    pub fn u8(mut self, value: u8) -> Self {
        self.bytes.push(value);
        self
    }

    /// Appends a `bool` as one byte, 0 or 1.
    pub fn bool(self, value: bool) -> Self {
        self.u8(u8::from(value))
    }

    /// Appends 4 bytes.
    pub fn u32(mut self, value: u32) -> Self {
        self.bytes.extend_from_slice(&value.to_le_bytes());
        self
    }

    /// Appends 8 bytes.
    pub fn u64(mut self, value: u64) -> Self {
        self.bytes.extend_from_slice(&value.to_le_bytes());
        self
    }

    /// Appends 8 bytes (the IEEE 754 bits, so every value round-trips exactly).
    pub fn f64(mut self, value: f64) -> Self {
        self.bytes.extend_from_slice(&value.to_le_bytes());
        self
    }

    /// The state, tagged with the policy's own `schema_version` for these bytes.
    pub fn finish(self, schema_version: u32) -> State {
        State {
            schema_version,
            bytes: self.bytes,
        }
    }
}

/// Reads back what a [`StateWriter`] wrote, in the same order. Every read checks the
/// length, so truncated or foreign bytes give an error, never a panic.
#[derive(Debug, Clone)]
pub struct StateReader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl<'a> StateReader<'a> {
    /// Starts reading at the first byte.
    pub fn new(bytes: &'a [u8]) -> Self {
        StateReader { bytes, offset: 0 }
    }

    fn take<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let rest = &self.bytes[self.offset..];
        let Some((head, _)) = rest.split_first_chunk::<N>() else {
            return Err(format!(
                "state ends early: a {what} needs {N} bytes at offset {}, {} left",
                self.offset,
                rest.len()
            ));
        };
        self.offset += N;
        Ok(*head)
    }

    /// Reads one byte.
    ///
    /// # Errors
    /// When no bytes are left.
    pub fn u8(&mut self) -> Result<u8, String> {
        self.take::<1>("u8").map(|[byte]| byte)
    }

    /// Reads a `bool` written by [`StateWriter::bool`].
    ///
    /// # Errors
    /// When no bytes are left, or the byte is neither 0 nor 1.
    pub fn bool(&mut self) -> Result<bool, String> {
        let offset = self.offset;
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(format!(
                "state holds {other} at offset {offset} where a bool (0 or 1) belongs"
            )),
        }
    }

    /// Reads 4 bytes.
    ///
    /// # Errors
    /// When fewer than 4 bytes are left.
    pub fn u32(&mut self) -> Result<u32, String> {
        self.take("u32").map(u32::from_le_bytes)
    }

    /// Reads 8 bytes.
    ///
    /// # Errors
    /// When fewer than 8 bytes are left.
    pub fn u64(&mut self) -> Result<u64, String> {
        self.take("u64").map(u64::from_le_bytes)
    }

    /// Reads 8 bytes as an `f64`. Any bit pattern is accepted, NaN included: check
    /// values that must be finite.
    ///
    /// # Errors
    /// When fewer than 8 bytes are left.
    pub fn f64(&mut self) -> Result<f64, String> {
        self.take("f64").map(f64::from_le_bytes)
    }

    /// Checks that every byte was read.
    ///
    /// # Errors
    /// When bytes are left over, which means the state was written by a different
    /// layout than the one being read.
    pub fn finish(self) -> Result<(), String> {
        let left = self.bytes.len() - self.offset;
        if left == 0 {
            Ok(())
        } else {
            Err(format!(
                "state has {left} unexpected bytes after offset {}",
                self.offset
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_round_trips() {
        let state = StateWriter::new()
            .u8(7)
            .bool(false)
            .u32(0xDEAD_BEEF)
            .u64(u64::MAX - 1)
            .f64(-0.125)
            .f64(f64::INFINITY)
            .finish(3);
        assert_eq!(state.schema_version, 3);
        assert_eq!(state.bytes.len(), 1 + 1 + 4 + 8 + 8 + 8);
        let mut reader = StateReader::new(&state.bytes);
        assert_eq!(reader.u8(), Ok(7));
        assert_eq!(reader.bool(), Ok(false));
        assert_eq!(reader.u32(), Ok(0xDEAD_BEEF));
        assert_eq!(reader.u64(), Ok(u64::MAX - 1));
        assert_eq!(reader.f64(), Ok(-0.125));
        assert_eq!(reader.f64(), Ok(f64::INFINITY));
        assert_eq!(reader.finish(), Ok(()));
    }

    #[test]
    fn integers_are_little_endian() {
        let state = StateWriter::new().u32(1).u64(2).finish(1);
        assert_eq!(state.bytes, [1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn truncated_state_is_an_error_naming_the_offset() {
        let bytes = [1, 2, 3];
        let mut reader = StateReader::new(&bytes);
        assert_eq!(reader.u8(), Ok(1));
        let error = reader.u32().expect_err("only 2 bytes are left");
        assert!(error.contains("offset 1"), "{error}");
        assert!(error.contains("2 left"), "{error}");
    }

    #[test]
    fn leftover_bytes_and_bad_bools_are_errors() {
        let mut reader = StateReader::new(&[1, 2]);
        assert_eq!(reader.bool(), Ok(true));
        let error = reader.clone().finish().expect_err("one byte is left");
        assert!(error.contains("1 unexpected bytes"), "{error}");
        let error = reader.bool().expect_err("2 is not a bool");
        assert!(error.contains("offset 1"), "{error}");
    }

    #[test]
    fn empty_state_is_schema_zero_without_bytes() {
        assert!(State::empty().is_empty());
        assert!(!StateWriter::new().finish(1).is_empty());
        assert!(!StateWriter::new().u8(0).finish(0).is_empty());
    }
}

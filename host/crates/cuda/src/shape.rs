//! What the CUDA kernels need of a model shape, beyond what [`tokwatt_core::model`] checks for every
//! backend. The shape type itself and its byte arithmetic live in [`tokwatt_core::model`].

pub use tokwatt_core::model::{BYTES_PER_PARAM as BYTES_PER_ELEMENT, ModelError, ModelShape};

/// Head sizes the attention kernel is compiled for.
pub const SUPPORTED_HEAD_DIMS: [u32; 2] = [64, 128];
/// Query heads per KV head the attention kernel is compiled for.
pub const SUPPORTED_GROUP_SIZES: [u32; 5] = [1, 2, 3, 4, 8];

/// Why a model shape cannot run on the CUDA workload.
#[derive(Debug, thiserror::Error)]
pub enum ShapeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("model '{model}' has a shape the CUDA kernels do not support: {reason}")]
    Unsupported { model: String, reason: String },
}

/// Checks the shape, then what the kernels rely on: every row a whole number of 16-byte
/// vectors, and a head size and group size the attention kernel is built for.
pub fn check_supported(shape: &ModelShape) -> Result<(), ShapeError> {
    shape.validate()?;
    let unsupported = |reason: String| ShapeError::Unsupported {
        model: shape.name.clone(),
        reason,
    };
    for (field, value) in [
        ("hidden", shape.hidden),
        ("mlp", shape.mlp),
        ("vocab", shape.vocab),
    ] {
        if !value.is_multiple_of(8) {
            return Err(unsupported(format!(
                "{field} = {value} is not a multiple of 8 (rows are read as 16-byte vectors)"
            )));
        }
    }
    if !SUPPORTED_HEAD_DIMS.contains(&shape.head_dim) {
        return Err(unsupported(format!(
            "head_dim = {} (supported: {SUPPORTED_HEAD_DIMS:?})",
            shape.head_dim
        )));
    }
    if !SUPPORTED_GROUP_SIZES.contains(&shape.group_size()) {
        return Err(unsupported(format!(
            "{} query heads per KV head (supported: {SUPPORTED_GROUP_SIZES:?})",
            shape.group_size()
        )));
    }
    // Element counts are handed to kernels as 32-bit integers.
    let widest = u64::from(shape.hidden).max(u64::from(shape.mlp)) * 2;
    if widest > u64::from(i32::MAX as u32)
        || u64::from(shape.qkv_dim()) > u64::from(i32::MAX as u32)
    {
        return Err(unsupported("a dimension exceeds 2^31".to_owned()));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    #[test]
    fn every_preset_but_none_of_the_kernels_limits_passes() {
        for (name, shape) in tokwatt_core::model::presets().unwrap() {
            check_supported(&shape).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn shapes_the_kernels_cannot_run_are_refused_with_the_reason() {
        let base = ModelShape::preset("llama-3-8b").unwrap();
        type Mutation = fn(&mut ModelShape);
        let cases: [(Mutation, &str); 5] = [
            (|s| s.hidden = 4100, "hidden = 4100 is not a multiple of 8"),
            (|s| s.head_dim = 96, "head_dim = 96"),
            (|s| s.heads = 80, "10 query heads per KV head"),
            // The backend-neutral checks come first.
            (|s| s.kv_heads = 5, "not a multiple of kv_heads = 5"),
            (|s| s.layers = 0, "layers must be at least 1"),
        ];
        for (mutate, expected) in cases {
            let mut shape = base.clone();
            mutate(&mut shape);
            let err = check_supported(&shape).unwrap_err().to_string();
            assert!(err.contains(expected), "{err} should mention {expected}");
            assert!(err.contains("llama-3-8b"), "{err}");
        }
    }
}

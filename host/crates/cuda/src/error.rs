//! The CUDA workload's error type.

use super::shape::ShapeError;

/// Why the CUDA decode workload could not start or continue. Every variant carries plain
/// data, so errors cross threads and say what to do next.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA driver not found (libcuda.so): {0}")]
    DriverNotFound(String),
    #[error("cuBLAS not found (libcublas.so): {0}")]
    CublasNotFound(String),
    #[error("NVRTC not found (libnvrtc.so): {0}")]
    NvrtcNotFound(String),
    #[error("no CUDA GPU with index {index}: {reason}")]
    NoGpu { index: u32, reason: String },
    #[error("GPU '{name}' (compute capability {major}.{minor}) is not supported: {reason}")]
    UnsupportedGpu {
        name: String,
        major: i32,
        minor: i32,
        reason: String,
    },
    #[error(
        "out of GPU memory: {what} needs {:.2} GiB but only {:.2} GiB are free; lower the batch size maximum or the context length, or pick a smaller model",
        gib(*.needed_bytes),
        gib(*.free_bytes)
    )]
    OutOfMemory {
        what: String,
        needed_bytes: u64,
        free_bytes: u64,
    },
    #[error("NVRTC could not compile the decode kernels ({status}): {log}")]
    Compile { status: String, log: String },
    #[error("kernel '{name}' could not be loaded from the compiled module: {reason}")]
    MissingKernel { name: String, reason: String },
    #[error("CUDA driver call {call} failed: {reason}")]
    Driver { call: &'static str, reason: String },
    #[error("cuBLAS call {call} failed: {reason}")]
    Cublas { call: &'static str, reason: String },
    #[error("invalid CUDA workload configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Shape(#[from] ShapeError),
    #[error("the CUDA decode thread stopped: {0}")]
    ThreadStopped(String),
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

impl CudaError {
    /// A failed driver call.
    pub(crate) fn driver(call: &'static str, error: cudarc::driver::DriverError) -> CudaError {
        let name = error
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{error:?}"));
        let text = error
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        CudaError::Driver {
            call,
            reason: if text.is_empty() {
                name
            } else {
                format!("{name}: {text}")
            },
        }
    }

    /// A failed allocation: out-of-memory gets its own variant.
    pub(crate) fn alloc(
        what: &str,
        bytes: u64,
        error: cudarc::driver::DriverError,
        free_bytes: u64,
    ) -> CudaError {
        use cudarc::driver::sys::CUresult;
        if error.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            CudaError::OutOfMemory {
                what: what.to_owned(),
                needed_bytes: bytes,
                free_bytes,
            }
        } else {
            CudaError::driver("cuMemAlloc", error)
        }
    }

    pub(crate) fn cublas(
        call: &'static str,
        error: cudarc::cublas::result::CublasError,
    ) -> CudaError {
        CudaError::Cublas {
            call,
            reason: format!("{:?}", error.0),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_says_how_much_and_what_to_change() {
        let err = CudaError::OutOfMemory {
            what: "weights and a KV cache of 512 x 1024 positions".into(),
            needed_bytes: 90 << 30,
            free_bytes: 80 << 30,
        };
        let text = err.to_string();
        assert!(
            text.contains("needs 90.00 GiB but only 80.00 GiB are free"),
            "{text}"
        );
        assert!(text.contains("lower the batch size maximum"), "{text}");
    }

    #[test]
    fn missing_driver_names_the_library() {
        let text = CudaError::DriverNotFound("no NVIDIA driver is installed".into()).to_string();
        assert!(
            text.starts_with("CUDA driver not found (libcuda.so): "),
            "{text}"
        );
    }
}

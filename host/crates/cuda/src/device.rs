//! One GPU as the decode engine sees it: a context, a stream, a cuBLAS handle with its own
//! workspace, and the NVRTC-compiled kernels. Together with the engine this is the only code
//! that knows cudarc.
//!
//! One file because it holds every raw driver, NVRTC and cuBLAS call (and their `unsafe`
//! blocks), kept together so that the safety of each call can be read in one place; its
//! parts (compile, kernel table, `Gpu`) are short and in that order.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{CudaBlas, sys as cublas_sys};
use cudarc::driver::sys as cu;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use cudarc::nvrtc::{Ptx, result as nvrtc, sys as nvrtc_sys};

use super::error::CudaError;
use super::plan::{ATTENTION_SCORE_BYTES, GEMV_MAX_BATCH};
use super::shape::{SUPPORTED_GROUP_SIZES, SUPPORTED_HEAD_DIMS};

/// The kernels' source, compiled at run time for the GPU found.
pub(crate) const KERNELS_CU: &str = include_str!("kernels.cu");

/// cuBLAS gets its own workspace so that its GEMMs can be captured into CUDA graphs.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Threads per block of the matrix-vector kernels (8 warps; must match `GEMV_THREADS`).
pub(crate) const GEMV_THREADS: u32 = 256;
/// Output rows per block of the matrix-vector kernels (8 warps of one row each).
pub(crate) const GEMV_ROWS_PER_BLOCK: u32 = 8;
/// Threads per attention block (must match `ATT_THREADS`).
pub(crate) const ATTENTION_THREADS: u32 = 128;
/// Shared memory a block may use without opting in to more.
const DEFAULT_SHARED_LIMIT: i32 = 48 * 1024;
/// Threads per prefill attention block (must match `FA_THREADS`).
pub(crate) const FLASH_PREFILL_THREADS: u32 = 128;

/// How the prefill attention tiles its work (`flash_prefill_hd*_m*_n*` in `kernels.cu`): each
/// of a block's 4 warps owns `row_tiles` tiles of 16 query rows, and keys stream through
/// shared memory `key_tile` positions at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PrefillAttention {
    /// 64 query rows per block, key tiles of 64.
    M1N64,
    /// 128 query rows per block, key tiles of 32 (flash-attention 2's tiling for head_dim
    /// 128): each key and value fragment feeds two row tiles.
    M2N32,
    /// 128 query rows per block, key tiles of 64.
    #[default]
    M2N64,
}

impl PrefillAttention {
    pub const ALL: [PrefillAttention; 3] = [
        PrefillAttention::M1N64,
        PrefillAttention::M2N32,
        PrefillAttention::M2N64,
    ];

    /// Row tiles of 16 per warp, and key positions per tile.
    fn tiling(self) -> (u32, u32) {
        match self {
            PrefillAttention::M1N64 => (1, 64),
            PrefillAttention::M2N32 => (2, 32),
            PrefillAttention::M2N64 => (2, 64),
        }
    }

    /// E.g. `m2n64`.
    pub fn name(self) -> &'static str {
        match self {
            PrefillAttention::M1N64 => "m1n64",
            PrefillAttention::M2N32 => "m2n32",
            PrefillAttention::M2N64 => "m2n64",
        }
    }

    pub fn from_name(name: &str) -> Option<PrefillAttention> {
        PrefillAttention::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Query rows per block.
    pub fn rows_per_block(self) -> u32 {
        64 * self.tiling().0
    }

    /// Dynamic shared memory of a block: the query tile and two buffers each of key and value
    /// tiles, rows of `head_dim` bf16 (must match `flash_prefill_impl`).
    pub fn shared_bytes(self, head_dim: u32) -> u32 {
        let (row_tiles, key_tile) = self.tiling();
        (64 * row_tiles + 4 * key_tile) * head_dim * 2
    }

    fn kernel_name(self, head_dim: u32) -> String {
        let (row_tiles, key_tile) = self.tiling();
        format!("flash_prefill_hd{head_dim}_m{row_tiles}_n{key_tile}")
    }
}

/// Checks that the driver, cuBLAS and NVRTC libraries can be loaded, so that a machine without
/// them gets an error rather than a panic from the lazy loaders.
pub(crate) fn check_libraries() -> Result<(), CudaError> {
    // SAFETY: each call only tries to dlopen the library under its usual names.
    if !unsafe { cu::is_culib_present() } {
        return Err(CudaError::DriverNotFound(
            "no NVIDIA driver library could be loaded; install the NVIDIA driver, or run the CUDA \
             workload on a machine with a GPU (the simulator needs none)"
                .into(),
        ));
    }
    // SAFETY: as above.
    if !unsafe { cublas_sys::is_culib_present() } {
        return Err(CudaError::CublasNotFound(
            "install the CUDA toolkit's cuBLAS and put its library folder (e.g. \
             /usr/local/cuda/lib64) on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    // SAFETY: as above.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(CudaError::NvrtcNotFound(
            "install the CUDA toolkit's NVRTC and put its library folder (e.g. \
             /usr/local/cuda/lib64) on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    Ok(())
}

/// Compiles the kernels to a cubin for `arch` (e.g. `sm_90`). Compiled once per process and
/// architecture: NVRTC takes seconds for the unrolled kernels.
pub(crate) fn compile_kernels(arch: &str) -> Result<Arc<Vec<u8>>, CudaError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<Vec<u8>>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // A poisoned cache only means another thread panicked mid-insert; the map is still valid.
    let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(cubin) = cache.get(arch) {
        return Ok(cubin.clone());
    }
    let cubin = Arc::new(nvrtc_compile(KERNELS_CU, arch)?);
    cache.insert(arch.to_owned(), cubin.clone());
    Ok(cubin)
}

fn nvrtc_compile(source: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    let compile_error = |status: nvrtc::NvrtcError, log: String| CudaError::Compile {
        status: format!("{:?}", status.0),
        log,
    };
    let source = CString::new(source).map_err(|e| CudaError::Compile {
        status: "invalid source".into(),
        log: e.to_string(),
    })?;
    let program = nvrtc::create_program(&source, Some(c"tokwatt_decode.cu"))
        .map_err(|e| compile_error(e, String::new()))?;
    let options = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_owned(),
    ];
    // SAFETY: `program` was created above and is destroyed exactly once, below.
    let compiled = unsafe { nvrtc::compile_program(program, &options) };
    let result = match compiled {
        Ok(()) => cubin_of(program).map_err(|e| compile_error(e, String::new())),
        Err(status) => {
            // SAFETY: as above.
            let log = unsafe { nvrtc::get_program_log(program) }
                .map(|chars| {
                    let bytes: Vec<u8> = chars
                        .iter()
                        .map(|&c| c as u8)
                        .take_while(|&c| c != 0)
                        .collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .unwrap_or_default();
            Err(compile_error(status, log))
        }
    };
    // SAFETY: as above; a failure to free is not worth failing the compile for.
    let _ = unsafe { nvrtc::destroy_program(program) };
    result
}

fn cubin_of(program: nvrtc_sys::nvrtcProgram) -> Result<Vec<u8>, nvrtc::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: `program` is a successfully compiled program; the buffer has `size` bytes.
    unsafe {
        nvrtc_sys::nvrtcGetCUBINSize(program, &mut size).result()?;
        let mut cubin = vec![0u8; size];
        nvrtc_sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast()).result()?;
        Ok(cubin)
    }
}

/// The three fused forms of the matrix-vector kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemvMode {
    /// RMSNorm of X fused in; Y = W·norm(X) (fused QKV, output head).
    NormStore,
    /// Y += W·X, and the new Y's sums of squares accumulated (O and down projections).
    Residual,
    /// RMSNorm fused in; Y = silu(gate) · up from the stacked gate/up rows.
    NormSilu,
}

impl GemvMode {
    const ALL: [GemvMode; 3] = [GemvMode::NormStore, GemvMode::Residual, GemvMode::NormSilu];

    fn kernel_name(self, batch: u32) -> String {
        let stem = match self {
            GemvMode::NormStore => "gemv_norm_store",
            GemvMode::Residual => "gemv_residual",
            GemvMode::NormSilu => "gemv_norm_silu",
        };
        format!("{stem}_b{batch}")
    }
}

/// Every kernel of the module, looked up once.
#[derive(Debug)]
pub(crate) struct Kernels {
    pub fill_uniform: CudaFunction,
    pub scale_columns: CudaFunction,
    pub embed: CudaFunction,
    pub rmsnorm: CudaFunction,
    pub silu_mul: CudaFunction,
    /// RoPE on its own: the step fuses it into attention; tests check it against the CPU.
    #[cfg_attr(not(test), allow(dead_code))]
    pub rope_qk: CudaFunction,
    pub argmax: CudaFunction,
    /// Indexed by batch - 1, then by mode.
    gemv: Vec<[CudaFunction; 3]>,
    /// Keyed by (head_dim, group, implementation).
    attention: HashMap<(u32, u32, AttentionImpl), CudaFunction>,
    pub prefill_rope_kv: CudaFunction,
    pub gather_rows: CudaFunction,
    pub scatter_tokens: CudaFunction,
    pub slot_tokens_in: CudaFunction,
    /// Causal prefill attention, keyed by head_dim and tiling.
    flash_prefill: HashMap<(u32, PrefillAttention), CudaFunction>,
}

/// How decode attention does its arithmetic in its two passes (scores, then the weighted sum
/// of values); the engine times each and keeps the fastest. Each has been the fastest at some
/// batch size on the H200 (CUDA cores at batch 1, tensor-core scores at 1–4 and 512, tensor
/// cores from 16 on); the fourth pairing (values alone on tensor cores) never was on the
/// current kernel, and was removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionImpl {
    /// Both passes as fp32 FMAs on CUDA cores, butterfly sums across the lanes of a position.
    CudaCores,
    /// Both passes as bf16 `mma.sync` tiles of 16 positions on tensor cores, fp32 accumulation.
    TensorCores,
    /// Scores on tensor cores, values on CUDA cores.
    TensorScores,
}

impl AttentionImpl {
    pub const ALL: [AttentionImpl; 3] = [
        AttentionImpl::CudaCores,
        AttentionImpl::TensorCores,
        AttentionImpl::TensorScores,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AttentionImpl::CudaCores => "cuda-cores",
            AttentionImpl::TensorCores => "tensor-cores",
            AttentionImpl::TensorScores => "tensor-scores",
        }
    }

    /// A short name for tables: `cc`, `tc`, `tc-s`.
    pub fn short_name(self) -> &'static str {
        match self {
            AttentionImpl::CudaCores => "cc",
            AttentionImpl::TensorCores => "tc",
            AttentionImpl::TensorScores => "tc-s",
        }
    }

    /// The implementation called `name` (as [`AttentionImpl::name`] gives it).
    pub fn from_name(name: &str) -> Option<AttentionImpl> {
        AttentionImpl::ALL.into_iter().find(|i| i.name() == name)
    }
}

/// The kernel's name: `_k<UK>_v<UV>` give the score and value passes' unrolls on CUDA cores
/// (4, or 2 for 8 heads per KV head, whose accumulators need the registers), 0 for tensor cores.
fn attention_kernel_name(head_dim: u32, group: u32, implementation: AttentionImpl) -> String {
    let unroll = if group <= 4 { 4 } else { 2 };
    let (scores, values) = match implementation {
        AttentionImpl::CudaCores => (unroll, unroll),
        AttentionImpl::TensorCores => (0, 0),
        AttentionImpl::TensorScores => (0, unroll),
    };
    format!("attention_hd{head_dim}_g{group}_k{scores}_v{values}")
}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>, cubin: &[u8], clusters: bool) -> Result<Kernels, CudaError> {
        let module = ctx
            .load_module(Ptx::from_binary(cubin.to_vec()))
            .map_err(|e| CudaError::driver("cuModuleLoadData", e))?;
        let function = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| CudaError::MissingKernel {
                    name: name.to_owned(),
                    reason: format!("{e:?}"),
                })
        };
        let mut gemv = Vec::new();
        for batch in 1..=GEMV_MAX_BATCH {
            let [a, b, c] = GemvMode::ALL.map(|mode| mode.kernel_name(batch));
            gemv.push([function(&a)?, function(&b)?, function(&c)?]);
        }
        let mut attention = HashMap::new();
        for head_dim in SUPPORTED_HEAD_DIMS {
            for (group, implementation) in SUPPORTED_GROUP_SIZES
                .into_iter()
                .flat_map(|g| AttentionImpl::ALL.map(|i| (g, i)))
            {
                let name = attention_kernel_name(head_dim, group, implementation);
                let kernel = function(&name)?;
                let static_bytes = kernel
                    .shared_size_bytes()
                    .map_err(|e| CudaError::driver("cuFuncGetAttribute", e))?;
                if static_bytes + ATTENTION_SCORE_BYTES as i32 > DEFAULT_SHARED_LIMIT {
                    return Err(CudaError::MissingKernel {
                        name,
                        reason: format!(
                            "{static_bytes} bytes of static shared memory leave too little for the scores"
                        ),
                    });
                }
                if clusters {
                    // The split merge runs in clusters of up to 16 blocks, beyond the
                    // portable 8.
                    // SAFETY: a valid function handle and attribute.
                    unsafe {
                        cu::cuFuncSetAttribute(
                            kernel.cu_function(),
                            cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                            1,
                        )
                        .result()
                        .map_err(|e| CudaError::driver("cuFuncSetAttribute", e))?;
                    }
                }
                attention.insert((head_dim, group, implementation), kernel);
            }
        }
        let mut flash_prefill = HashMap::new();
        for (head_dim, tiling) in SUPPORTED_HEAD_DIMS
            .into_iter()
            .flat_map(|hd| PrefillAttention::ALL.map(|t| (hd, t)))
        {
            let kernel = function(&tiling.kernel_name(head_dim))?;
            let bytes = i32::try_from(tiling.shared_bytes(head_dim)).unwrap_or(i32::MAX);
            // Above 48 KB a kernel must opt in to its dynamic shared memory.
            // SAFETY: a valid function handle and attribute.
            unsafe {
                cu::cuFuncSetAttribute(
                    kernel.cu_function(),
                    cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes,
                )
                .result()
                .map_err(|e| CudaError::driver("cuFuncSetAttribute", e))?;
            }
            flash_prefill.insert((head_dim, tiling), kernel);
        }
        Ok(Kernels {
            prefill_rope_kv: function("prefill_rope_kv")?,
            gather_rows: function("gather_rows")?,
            scatter_tokens: function("scatter_tokens")?,
            slot_tokens_in: function("slot_tokens_in")?,
            flash_prefill,
            fill_uniform: function("fill_uniform")?,
            scale_columns: function("scale_columns")?,
            embed: function("embed")?,
            rmsnorm: function("rmsnorm")?,
            silu_mul: function("silu_mul")?,
            rope_qk: function("rope_qk")?,
            argmax: function("argmax")?,
            gemv,
            attention,
        })
    }

    /// The matrix-vector kernel for `batch` (1..=GEMV_MAX_BATCH).
    pub fn gemv(&self, mode: GemvMode, batch: u32) -> Option<&CudaFunction> {
        let index = usize::try_from(batch.checked_sub(1)?).ok()?;
        let forms = self.gemv.get(index)?;
        Some(match mode {
            GemvMode::NormStore => &forms[0],
            GemvMode::Residual => &forms[1],
            GemvMode::NormSilu => &forms[2],
        })
    }

    /// The causal prefill attention for `head_dim` with `tiling`.
    pub fn flash_prefill(&self, head_dim: u32, tiling: PrefillAttention) -> Option<&CudaFunction> {
        self.flash_prefill.get(&(head_dim, tiling))
    }

    pub fn attention(
        &self,
        head_dim: u32,
        group: u32,
        implementation: AttentionImpl,
    ) -> Option<&CudaFunction> {
        self.attention.get(&(head_dim, group, implementation))
    }
}

/// A kernel argument, passed by value.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    /// A device address.
    Ptr(u64),
    I32(i32),
    U64(u64),
    F32(f32),
}

impl Arg {
    fn as_param(&self) -> *mut c_void {
        match self {
            Arg::Ptr(v) | Arg::U64(v) => v as *const u64 as *mut c_void,
            Arg::I32(v) => v as *const i32 as *mut c_void,
            Arg::F32(v) => v as *const f32 as *mut c_void,
        }
    }
}

/// Converts a count to the 32-bit integer a kernel takes.
pub(crate) fn int(value: impl TryInto<i32>, what: &str) -> Result<Arg, CudaError> {
    value
        .try_into()
        .map(Arg::I32)
        .map_err(|_| CudaError::Config(format!("{what} does not fit a 32-bit kernel argument")))
}

/// Blocks of 256 threads for a grid-stride kernel over `elements`: one element per thread, at
/// most 65 535 blocks (the threads then loop).
fn grid_stride_blocks(elements: u64) -> u32 {
    u32::try_from(elements.div_ceil(256))
        .unwrap_or(u32::MAX)
        .clamp(1, 65_535)
}

/// A launch attribute that groups blocks into clusters of `x` along the grid's x.
fn cluster_attribute(x: u32) -> cu::CUlaunchAttribute {
    // SAFETY: a zeroed attribute is a valid value for this plain C struct.
    let mut attribute: cu::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attribute.value.clusterDim.x = x;
    attribute.value.clusterDim.y = 1;
    attribute.value.clusterDim.z = 1;
    attribute
}

fn launch_config(
    grid: (u32, u32, u32),
    block: u32,
    shared_bytes: u32,
    stream: &CudaStream,
    attrs: *mut cu::CUlaunchAttribute,
    count: u32,
) -> cu::CUlaunchConfig {
    cu::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shared_bytes,
        hStream: stream.cu_stream(),
        attrs: if count == 0 {
            std::ptr::null_mut()
        } else {
            attrs
        },
        numAttrs: count,
    }
}

/// One GPU, ready to run decode kernels.
#[derive(Debug)]
pub(crate) struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    _blas_workspace: CudaSlice<u8>,
    pub kernels: Kernels,
    pub name: String,
    pub sms: u32,
    /// Compute capability 9.0 or newer (Hopper): thread block clusters.
    hopper: bool,
    /// Answers of [`Gpu::cluster_fits`]: the driver's occupancy query is asked once per
    /// launch shape, not at every attention launch a graph capture enqueues.
    cluster_fit_answers: Mutex<HashMap<ClusterShape, bool>>,
}

/// A kernel's launch shape as clusters of `cluster_x` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ClusterShape {
    /// The `CUfunction` handle's address: stable while the module is loaded, which it is for
    /// the life of `Gpu`.
    kernel: usize,
    grid: (u32, u32, u32),
    block: u32,
    shared_bytes: u32,
    cluster_x: u32,
}

impl Gpu {
    /// Opens GPU `ordinal`, compiles and loads the kernels, and sets up cuBLAS.
    pub fn open(ordinal: u32) -> Result<Gpu, CudaError> {
        check_libraries()?;
        let index = usize::try_from(ordinal).map_err(|_| CudaError::NoGpu {
            index: ordinal,
            reason: "index out of range".into(),
        })?;
        let ctx = CudaContext::new(index).map_err(|e| CudaError::NoGpu {
            index: ordinal,
            reason: CudaError::driver("cuInit/cuDevicePrimaryCtxRetain", e).to_string(),
        })?;
        // One stream, ordered by construction: cudarc's per-buffer event tracking would only
        // add events, and it breaks graph capture of cuBLAS calls. Must precede every allocation.
        // SAFETY: all work of this context goes to the one stream created below.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| CudaError::driver("cuStreamCreate", e))?;
        let name = ctx
            .name()
            .map_err(|e| CudaError::driver("cuDeviceGetName", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute", e))?;
        if major < 8 {
            return Err(CudaError::UnsupportedGpu {
                name,
                major,
                minor,
                reason: "the bf16 kernels need compute capability 8.0 (Ampere) or newer".into(),
            });
        }
        let sms = ctx
            .attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute", e))?;
        let cubin = compile_kernels(&format!("sm_{major}{minor}"))?;
        let kernels = Kernels::load(&ctx, &cubin, major >= 9)?;

        let blas =
            CudaBlas::new(stream.clone()).map_err(|e| CudaError::cublas("cublasCreate", e))?;
        // SAFETY: uninitialised scratch memory is what a cuBLAS workspace is.
        let workspace = unsafe { stream.alloc::<u8>(CUBLAS_WORKSPACE_BYTES) }.map_err(|e| {
            CudaError::alloc("the cuBLAS workspace", CUBLAS_WORKSPACE_BYTES as u64, e, 0)
        })?;
        let (workspace_ptr, _sync) = workspace.device_ptr(&stream);
        // SAFETY: the handle and the workspace live as long as `Gpu`; the workspace is only
        // used by this handle.
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(
                *blas.handle(),
                workspace_ptr as *mut c_void,
                CUBLAS_WORKSPACE_BYTES,
            )
            .result()
            .map_err(|e| CudaError::cublas("cublasSetWorkspace", e))?;
        }
        drop(_sync);
        Ok(Gpu {
            ctx,
            stream,
            blas,
            _blas_workspace: workspace,
            kernels,
            name,
            sms: u32::try_from(sms).unwrap_or(1).max(1),
            hopper: major >= 9,
            cluster_fit_answers: Mutex::new(HashMap::new()),
        })
    }

    /// Makes this GPU's context current on the calling thread (raw driver and cuBLAS calls need it).
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("cuCtxSetCurrent", e))
    }

    /// Free and total device memory, bytes.
    pub fn memory(&self) -> Result<(u64, u64), CudaError> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| CudaError::driver("cuMemGetInfo", e))?;
        Ok((free as u64, total as u64))
    }

    /// Allocates `len` uninitialised elements; `what` names the buffer in errors.
    pub fn alloc<T: DeviceRepr>(&self, what: &str, len: u64) -> Result<CudaSlice<T>, CudaError> {
        let bytes = len.saturating_mul(std::mem::size_of::<T>() as u64);
        let free = self.memory().map(|(free, _)| free).unwrap_or(0);
        let len = usize::try_from(len).map_err(|_| CudaError::OutOfMemory {
            what: what.to_owned(),
            needed_bytes: bytes,
            free_bytes: free,
        })?;
        // SAFETY: every buffer is written (random fill or a kernel) before it is read.
        unsafe { self.stream.alloc::<T>(len) }.map_err(|e| CudaError::alloc(what, bytes, e, free))
    }

    /// Allocates `len` zeroed elements.
    pub fn alloc_zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        what: &str,
        len: u64,
    ) -> Result<CudaSlice<T>, CudaError> {
        let mut slice = self.alloc::<T>(what, len)?;
        self.stream
            .memset_zeros(&mut slice)
            .map_err(|e| CudaError::driver("cuMemsetD8Async", e))?;
        Ok(slice)
    }

    /// The device address of `slice` plus `offset` elements.
    pub fn addr<T>(&self, slice: &CudaSlice<T>, offset: u64) -> u64 {
        let (base, _sync) = slice.device_ptr(&self.stream);
        base + offset * std::mem::size_of::<T>() as u64
    }

    /// Copies host data into the start of `slice`.
    pub fn upload<T: DeviceRepr>(
        &self,
        data: &[T],
        slice: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        if data.len() > slice.len() {
            return Err(CudaError::Config(format!(
                "upload of {} elements into a buffer of {}",
                data.len(),
                slice.len()
            )));
        }
        self.stream
            .memcpy_htod(data, slice)
            .map_err(|e| CudaError::driver("cuMemcpyHtoDAsync", e))
    }

    /// Copies the first `len` elements of `slice` to the host (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        slice: &CudaSlice<T>,
        len: usize,
    ) -> Result<Vec<T>, CudaError> {
        let view = slice.try_slice(0..len).ok_or_else(|| {
            CudaError::Config(format!(
                "download of {len} elements from a buffer of {}",
                slice.len()
            ))
        })?;
        self.stream
            .clone_dtoh(&view)
            .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync", e))
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("cuStreamSynchronize", e))
    }

    /// Launches `kernel` on the stream.
    pub fn launch(
        &self,
        kernel: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        self.launch_with(kernel, grid, block, shared_bytes, args, None)
    }

    /// Whether this GPU runs thread block clusters (Hopper and newer).
    pub fn clusters_supported(&self) -> bool {
        self.hopper
    }

    /// Whether `kernel` can run as clusters of `cluster_x` blocks along x with this launch
    /// shape (the GPU has them and some multiprocessor group holds a whole cluster).
    pub fn cluster_fits(
        &self,
        kernel: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        cluster_x: u32,
    ) -> bool {
        if !self.clusters_supported() || cluster_x == 0 || !grid.0.is_multiple_of(cluster_x) {
            return false;
        }
        let shape = ClusterShape {
            kernel: kernel.cu_function() as usize,
            grid,
            block,
            shared_bytes,
            cluster_x,
        };
        // A poisoned lock only means another thread panicked mid-insert: the map is still
        // a valid cache.
        let mut answers = self
            .cluster_fit_answers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *answers.entry(shape).or_insert_with(|| {
            let mut attribute = cluster_attribute(cluster_x);
            let config = launch_config(grid, block, shared_bytes, &self.stream, &mut attribute, 1);
            let mut clusters = 0i32;
            // SAFETY: `config` and its attribute live across the call; the query launches
            // nothing.
            let status = unsafe {
                cu::cuOccupancyMaxActiveClusters(&mut clusters, kernel.cu_function(), &config)
            };
            status == cu::CUresult::CUDA_SUCCESS && clusters > 0
        })
    }

    /// Launch shapes whose cluster fit has been asked of the driver.
    #[cfg(test)]
    pub fn cluster_shapes_asked(&self) -> usize {
        self.cluster_fit_answers
            .lock()
            .map_or(0, |answers| answers.len())
    }

    /// Launches `kernel` as clusters of `cluster_x` blocks along x (check [`Gpu::cluster_fits`]
    /// first).
    pub fn launch_in_clusters(
        &self,
        kernel: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        args: &[Arg],
        cluster_x: u32,
    ) -> Result<(), CudaError> {
        self.launch_with(kernel, grid, block, shared_bytes, args, Some(cluster_x))
    }

    fn launch_with(
        &self,
        kernel: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        args: &[Arg],
        cluster_x: Option<u32>,
    ) -> Result<(), CudaError> {
        let mut params: Vec<*mut c_void> = args.iter().map(Arg::as_param).collect();
        let mut attributes: Vec<cu::CUlaunchAttribute> =
            cluster_x.map(cluster_attribute).into_iter().collect();
        let count = u32::try_from(attributes.len()).unwrap_or(0);
        let config = launch_config(
            grid,
            block,
            shared_bytes,
            &self.stream,
            attributes.as_mut_ptr(),
            count,
        );
        // SAFETY: `params` points at `args`, and `config` at `attributes`, which outlive the
        // call; the caller passes the arguments in the kernel's order and types, and buffers
        // sized for the launch.
        unsafe {
            cu::cuLaunchKernelEx(
                &config,
                kernel.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
            .map_err(|e| CudaError::driver("cuLaunchKernelEx", e))
        }
    }

    /// Y[batch, out] (row stride `ldy`) = X[batch, in] (row stride `ldx`) · Wᵀ, with W stored
    /// [out, in] row-major; with `accumulate`, adds to Y (the residual stream). bf16 in and out,
    /// fp32 accumulation.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        out_features: u32,
        batch: u32,
        in_features: u32,
        w: u64,
        x: u64,
        ldx: u32,
        y: u64,
        ldy: u32,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let dim = |v: u32| {
            i32::try_from(v)
                .map_err(|_| CudaError::Config(format!("GEMM dimension {v} exceeds 2^31")))
        };
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0 };
        // Column-major view: Yᵀ[out, batch] = W[in, out]ᵀ · Xᵀ[in, batch].
        // SAFETY: pointers address live buffers of at least the sizes these dimensions imply.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                dim(out_features)?,
                dim(batch)?,
                dim(in_features)?,
                (&alpha as *const f32).cast(),
                w as *const c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                dim(in_features)?,
                x as *const c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                dim(ldx)?,
                (&beta as *const f32).cast(),
                y as *mut c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                dim(ldy)?,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(|e| CudaError::cublas("cublasGemmEx", e))
        }
    }

    /// Fills `len` bf16 elements at `addr` with uniform values in [offset - scale, offset + scale).
    pub fn fill_uniform(
        &self,
        addr: u64,
        len: u64,
        seed: u64,
        scale: f32,
        offset: f32,
    ) -> Result<(), CudaError> {
        self.launch(
            &self.kernels.fill_uniform,
            (grid_stride_blocks(len), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(addr),
                Arg::U64(len),
                Arg::U64(seed),
                Arg::F32(scale),
                Arg::F32(offset),
            ],
        )
    }

    /// Folds RMSNorm weights `gamma` (`cols` of them) into the `[rows, cols]` matrix at `matrix`:
    /// each column scaled by its weight.
    pub fn scale_columns(
        &self,
        matrix: u64,
        rows: u32,
        cols: u32,
        gamma: u64,
    ) -> Result<(), CudaError> {
        self.launch(
            &self.kernels.scale_columns,
            (grid_stride_blocks(u64::from(rows) * u64::from(cols)), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(matrix),
                Arg::U64(u64::from(rows)),
                int(cols, "columns")?,
                Arg::Ptr(gamma),
            ],
        )
    }

    /// The largest dynamic shared memory an attention block may ask for.
    pub fn attention_shared_limit(&self) -> u32 {
        ATTENTION_SCORE_BYTES
    }

    pub fn attention_threads(&self) -> u32 {
        ATTENTION_THREADS
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    #[test]
    fn kernels_compile_with_nvrtc_when_it_is_installed() {
        // SAFETY: only tries to dlopen libnvrtc.
        if !unsafe { nvrtc_sys::is_culib_present() } {
            tokwatt_test_support::skip_gpu(
                "NVRTC (libnvrtc.so) not found; put its folder on LD_LIBRARY_PATH to check the kernels compile",
            );
            return;
        }
        let cubin = compile_kernels("sm_90").unwrap();
        // An ELF image holding every kernel the loader looks up.
        assert_eq!(&cubin[..4], b"\x7fELF");
        let text = String::from_utf8_lossy(&cubin);
        for batch in 1..=GEMV_MAX_BATCH {
            for mode in GemvMode::ALL {
                assert!(
                    text.contains(&mode.kernel_name(batch)),
                    "{}",
                    mode.kernel_name(batch)
                );
            }
        }
        for head_dim in SUPPORTED_HEAD_DIMS {
            for group in SUPPORTED_GROUP_SIZES {
                for implementation in AttentionImpl::ALL {
                    let name = attention_kernel_name(head_dim, group, implementation);
                    assert!(text.contains(&name), "{name}");
                }
            }
        }
        // The cache hands back the same image.
        assert!(Arc::ptr_eq(&cubin, &compile_kernels("sm_90").unwrap()));
    }

    #[test]
    fn a_compile_error_carries_nvrtc_log() {
        // SAFETY: only tries to dlopen libnvrtc.
        if !unsafe { nvrtc_sys::is_culib_present() } {
            tokwatt_test_support::skip_gpu("NVRTC (libnvrtc.so) not found");
            return;
        }
        let err = nvrtc_compile(
            "extern \"C\" __global__ void k() { undefined_thing(); }",
            "sm_90",
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("NVRTC could not compile"), "{text}");
        assert!(text.contains("undefined_thing"), "{text}");
    }
}

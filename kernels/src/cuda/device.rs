//! One CUDA device: context, stream, cuBLAS handle and the compiled kernels, with
//! a typed launch per kernel that checks buffer sizes on the host first; the KV
//! pool in device memory ([`DeviceKv`]); one step's block tables ([`StepTables`]).
//!
//! Everything runs on one stream, in order (cudarc's per-buffer event tracking is
//! off: nothing here uses a second stream). Reads back to the host synchronize.

use super::abi::{KvGeom, SeqTables, NO_FAILURE};
use super::nvrtc::Output;
use super::sources::SOURCES;
use super::{probe, CudaError};
use crate::page::{BlockRef, KvLayout, PageTag};
use crate::quant::QFormat;
use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr,
    LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use std::collections::HashMap;
use std::sync::Arc;

/// What was opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// The driver's name for it (e.g. `NVIDIA H200`).
    pub name: String,
    /// Compute capability (9, 0 on Hopper).
    pub compute_capability: (i32, i32),
    /// The architecture the kernels were compiled for (`sm_90`).
    pub arch: String,
    /// Device memory in bytes.
    pub total_bytes: usize,
    /// The driver's CUDA version (e.g. 13000 for 13.0).
    pub driver_version: i32,
    /// NVRTC library used and its version.
    pub nvrtc: String,
}

/// A CUDA device with the Tessera kernels loaded.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    info: DeviceInfo,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("info", &self.info)
            .finish()
    }
}

fn drv<T>(call: &'static str, r: Result<T, cudarc::driver::DriverError>) -> Result<T, CudaError> {
    r.map_err(|source| CudaError::Driver { call, source })
}

fn shape(ok: bool, what: impl FnOnce() -> String) -> Result<(), CudaError> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(what()))
    }
}

/// The driver's CUDA version (`cuDriverGetVersion`, e.g. 13000).
fn driver_version() -> Result<i32, CudaError> {
    let mut v = 0;
    // SAFETY: the driver library is loaded (probed) and `v` is a valid out-pointer.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    drv("cuDriverGetVersion", r.result())?;
    Ok(v)
}

/// Blocks of `threads` covering `n` items.
fn cover(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u64).div_ceil(threads as u64).max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` per row.
fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaDevice {
    /// Probes for the driver, NVRTC and cuBLAS ([`super::probe`]), creates the
    /// primary context of device `ordinal`, compiles every kernel source with NVRTC
    /// to CUBIN for the device's architecture (`sm_XY` from its compute capability)
    /// and loads them.
    ///
    /// Errors: what [`super::probe`] reports; [`CudaError::NoDevice`];
    /// [`CudaError::Nvrtc`] with the compile log; [`CudaError::Driver`] /
    /// [`CudaError::Cublas`] for failing calls.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let p = probe()?;
        let count = drv("cuDeviceGetCount", CudaContext::device_count())?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = drv("cuDevicePrimaryCtxRetain", CudaContext::new(ordinal))?;
        // SAFETY: this backend uses one stream only, so no cross-stream
        // synchronization of buffers is needed.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = drv("cuDeviceGetAttribute", ctx.compute_capability())?;
        let arch = format!("sm_{major}{minor}");
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|source| CudaError::Cublas {
            call: "cublasCreate",
            source,
        })?;
        let mut funcs = HashMap::new();
        for src in SOURCES {
            let cubin = p.nvrtc.compile(src, &arch, Output::Cubin)?;
            let module = drv(
                "cuModuleLoadData",
                ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)),
            )?;
            for &k in src.kernels {
                funcs.insert(k, drv("cuModuleGetFunction", module.load_function(k))?);
            }
        }
        let (nv_major, nv_minor) = p.nvrtc.version()?;
        let info = DeviceInfo {
            ordinal,
            name: drv("cuDeviceGetName", ctx.name())?,
            compute_capability: (major, minor),
            arch,
            total_bytes: drv("cuDeviceTotalMem", ctx.total_mem())?,
            driver_version: driver_version()?,
            nvrtc: format!("{} ({nv_major}.{nv_minor})", p.nvrtc.path()),
        };
        Ok(Self {
            ctx,
            stream,
            blas,
            funcs,
            info,
        })
    }

    /// What was opened.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        drv("cuMemGetInfo", self.ctx.mem_get_info())
    }

    /// The stream every launch and copy of this device runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for all work on the stream. Errors: a kernel's fault, reported here.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        drv("cuStreamSynchronize", self.stream.synchronize())
    }

    /// `n` zeroed elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        drv("cuMemAlloc", self.stream.alloc_zeros::<T>(n.max(1)))
    }

    /// A device copy of `data`.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, CudaError> {
        if data.is_empty() {
            // cudarc cannot allocate 0 bytes; a 1-element buffer is never read.
            // SAFETY: the element is never read before being written.
            return drv("cuMemAlloc", unsafe { self.stream.alloc::<T>(1) });
        }
        drv("cuMemcpyHtoD", self.stream.clone_htod(data))
    }

    /// Copies `data` into the start of `dst` (which must be at least as long).
    pub fn upload_into<T: DeviceRepr>(
        &self,
        data: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        shape(data.len() <= dst.len(), || {
            format!("upload of {} elements into {}", data.len(), dst.len())
        })?;
        if data.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut(..data.len());
        drv("cuMemcpyHtoD", self.stream.memcpy_htod(data, &mut view))
    }

    /// Copies the first `n` elements of `src` into `dst` at element `at`.
    pub fn copy_into<T: DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        n: usize,
        dst: &mut CudaSlice<T>,
        at: usize,
    ) -> Result<(), CudaError> {
        shape(n <= src.len() && at + n <= dst.len(), || {
            format!("copy of {n} elements to {at} of {}", dst.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let mut view = dst.slice_mut(at..at + n);
        drv(
            "cuMemcpyDtoD",
            self.stream.memcpy_dtod(&src.slice(..n), &mut view),
        )
    }

    /// The first `n` elements of `src`, on the host (synchronizes).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
        n: usize,
    ) -> Result<Vec<T>, CudaError> {
        shape(n <= src.len(), || {
            format!("download of {n} elements from {}", src.len())
        })?;
        let mut out = vec![T::default(); n];
        if n > 0 {
            drv(
                "cuMemcpyDtoH",
                self.stream.memcpy_dtoh(&src.slice(..n), &mut out),
            )?;
        }
        self.synchronize()?;
        Ok(out)
    }

    /// The device address of `s` (for the step-table structs).
    pub fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    fn f(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    /// Causal paged attention of every row of `a.tables` (prefill and decode rows
    /// alike, GQA): reads each page's tag before its bytes, records mismatches in
    /// the tables' failure words (see [`StepTables::failures`]); zero output for a
    /// failed row. Source: `cuda/attention.cu` `paged_attention`.
    ///
    /// Errors: [`CudaError::Shape`] when `head_dim` is not a multiple of 32 up to
    /// 256, `n_heads` not a multiple of `kv_heads`, more than 32 query heads per KV
    /// head, `q`/`out` shorter than `rows * stride`, or a sliding window is asked
    /// for ([`AttentionLaunch::window`]: the device kernel attends to every key
    /// `0..=pos`; windows run on the CPU kernel only, for now).
    pub fn paged_attention(&self, a: AttentionLaunch) -> Result<(), CudaError> {
        let l = a.kv.layout;
        let rows = a.tables.rows;
        shape(a.window.is_none(), || {
            format!(
                "sliding-window attention (window {:?}) is not supported by the CUDA \
                 kernel yet; run models with local-attention layers on the CPU backend",
                a.window
            )
        })?;
        shape(l.head_dim.is_multiple_of(32) && l.head_dim <= 256, || {
            format!(
                "head_dim {} (must be a multiple of 32, at most 256)",
                l.head_dim
            )
        })?;
        shape(
            a.n_heads.is_multiple_of(l.kv_heads) && a.n_heads / l.kv_heads <= 32,
            || format!("{} query heads over {} KV heads", a.n_heads, l.kv_heads),
        )?;
        shape(a.layer < l.layers, || {
            format!("layer {} of {}", a.layer, l.layers)
        })?;
        let row = a.n_heads * l.head_dim;
        shape(a.q_stride >= row && a.q.len() >= rows * a.q_stride, || {
            format!(
                "q: {} floats for {rows} rows of stride {}",
                a.q.len(),
                a.q_stride
            )
        })?;
        shape(
            a.out_stride >= row && a.out.len() >= rows * a.out_stride,
            || format!("out: {} floats for {rows} rows", a.out.len()),
        )?;
        if rows == 0 {
            return Ok(());
        }
        let group = (a.n_heads / l.kv_heads) as u32;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, l.kv_heads as u32, 1),
            block_dim: (32 * group, 1, 1),
            shared_mem_bytes: group * l.head_dim as u32 * 4,
        };
        let scale = std::f32::consts::LOG2_E / (l.head_dim as f32).sqrt();
        let (qs, os) = (a.q_stride as u32, a.out_stride as u32);
        let (layer, nh, check) = (a.layer as u32, a.n_heads as u32, a.check_tags as u32);
        let mut b = self.stream.launch_builder(self.f("paged_attention"));
        b.arg(a.q).arg(&qs).arg(a.out).arg(&os);
        b.arg(&a.kv.data)
            .arg(&a.kv.tags)
            .arg(&a.kv.geom)
            .arg(&a.tables.abi);
        b.arg(&layer).arg(&nh).arg(&check).arg(&scale);
        // SAFETY: argument list matches the kernel's signature; sizes checked above,
        // table contents bounds-checked by the kernel.
        drv("launch paged_attention", unsafe { b.launch(cfg) }).map(drop)
    }

    /// Quantizes each row's K and V into its slot of its page (after checking the
    /// page's tag). `qkv` is `[rows, qkv_stride]` f32 with K of KV head `h` at
    /// column `k_col + h * head_dim` and V at `v_col + h * head_dim`.
    /// Source: `cuda/attention.cu` `kv_store`.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        qkv: &CudaSlice<f32>,
        qkv_stride: usize,
        k_col: usize,
        v_col: usize,
        kv: &mut DeviceKv,
        tables: &StepTables,
        layer: usize,
        check_tags: bool,
    ) -> Result<(), CudaError> {
        let l = kv.layout;
        let kvd = l.kv_dim();
        shape(l.head_dim.is_multiple_of(32) && l.head_dim <= 256, || {
            format!("head_dim {}", l.head_dim)
        })?;
        shape(
            k_col + kvd <= qkv_stride && v_col + kvd <= qkv_stride,
            || format!("K at {k_col}, V at {v_col}: {kvd} wide, in rows of {qkv_stride}"),
        )?;
        shape(qkv.len() >= tables.rows * qkv_stride, || {
            "qkv shorter than the rows".into()
        })?;
        shape(layer < l.layers, || {
            format!("layer {layer} of {}", l.layers)
        })?;
        if tables.rows == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (tables.rows as u32, l.kv_heads as u32, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (st, kc, vc, ly, ck) = (
            qkv_stride as u32,
            k_col as u32,
            v_col as u32,
            layer as u32,
            check_tags as u32,
        );
        let mut b = self.stream.launch_builder(self.f("kv_store"));
        b.arg(qkv).arg(&st).arg(&kc).arg(&vc);
        b.arg(&mut kv.data)
            .arg(&kv.tags)
            .arg(&kv.geom)
            .arg(&tables.abi);
        b.arg(&ly).arg(&ck);
        // SAFETY: matches `kv_store`'s signature; sizes checked above.
        drv("launch kv_store", unsafe { b.launch(cfg) }).map(drop)
    }

    /// `x[r] = table[tokens[r]]` as f32 (`table`: bf16 `[vocab, d]`).
    pub fn embed_rows(
        &self,
        table: &CudaSlice<u16>,
        vocab: usize,
        tokens: &CudaSlice<u32>,
        n: usize,
        x: &mut CudaSlice<f32>,
        d: usize,
    ) -> Result<(), CudaError> {
        shape(
            table.len() >= vocab * d && tokens.len() >= n && x.len() >= n * d,
            || "embed_rows buffers".into(),
        )?;
        if n == 0 {
            return Ok(());
        }
        let (d32, v32) = (d as u32, vocab as u32);
        let mut b = self.stream.launch_builder(self.f("embed_rows"));
        b.arg(table).arg(tokens).arg(&d32).arg(&v32).arg(x);
        // SAFETY: matches `embed_rows`; sizes checked.
        drv("launch embed_rows", unsafe { b.launch(per_row(n, 256)) }).map(drop)
    }

    /// RMSNorm of `n` rows of `x` (`[*, d]`), row `i` read from `rows[i]` when
    /// given; writes `out_f32` and/or `out_bf16` (`[n, d]`).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        d: usize,
        n: usize,
        rows: Option<&CudaSlice<u32>>,
        out_f32: Option<&mut CudaSlice<f32>>,
        out_bf16: Option<&mut CudaSlice<u16>>,
    ) -> Result<(), CudaError> {
        shape(w.len() >= d && (rows.is_some() || x.len() >= n * d), || {
            "rms_norm x/w".into()
        })?;
        shape(rows.is_none_or(|r| r.len() >= n), || "rms_norm rows".into())?;
        shape(out_f32.as_ref().is_none_or(|o| o.len() >= n * d), || {
            "rms_norm out".into()
        })?;
        shape(out_bf16.as_ref().is_none_or(|o| o.len() >= n * d), || {
            "rms_norm out".into()
        })?;
        if n == 0 {
            return Ok(());
        }
        let null = 0u64;
        let d32 = d as u32;
        let mut b = self.stream.launch_builder(self.f("rms_norm"));
        b.arg(x).arg(w).arg(&eps).arg(&d32);
        match rows {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        match out_f32 {
            Some(o) => b.arg(o),
            None => b.arg(&null),
        };
        match out_bf16 {
            Some(o) => b.arg(o),
            None => b.arg(&null),
        };
        // SAFETY: matches `rms_norm`; null pointers where the kernel allows them.
        drv("launch rms_norm", unsafe { b.launch(per_row(n, 256)) }).map(drop)
    }

    /// RoPE in place on `heads` heads from column `col0` of each of `n` rows of `x`
    /// (`[n, stride]`), row `r` at position `pos[r]`; `inv_freq`: `[head_dim / 2]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        stride: usize,
        col0: usize,
        heads: usize,
        head_dim: usize,
        n: usize,
        pos: &CudaView<u32>,
        inv_freq: &CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        shape(
            col0 + heads * head_dim <= stride && x.len() >= n * stride && pos.len() >= n,
            || "rope buffers".into(),
        )?;
        shape(inv_freq.len() >= head_dim / 2, || "rope inv_freq".into())?;
        if n == 0 {
            return Ok(());
        }
        let (s, c, h, hd) = (stride as u32, col0 as u32, heads as u32, head_dim as u32);
        let mut b = self.stream.launch_builder(self.f("rope"));
        b.arg(x)
            .arg(&s)
            .arg(&c)
            .arg(&h)
            .arg(&hd)
            .arg(pos)
            .arg(inv_freq);
        // SAFETY: matches `rope`; sizes checked.
        drv("launch rope", unsafe { b.launch(per_row(n, 256)) }).map(drop)
    }

    /// SwiGLU of `n` rows of `gate_up` (`[n, 2 * ffn]`) into `out_f32` and/or
    /// `out_bf16` (`[n, ffn]`).
    pub fn swiglu(
        &self,
        gate_up: &CudaSlice<f32>,
        ffn: usize,
        n: usize,
        out_f32: Option<&mut CudaSlice<f32>>,
        out_bf16: Option<&mut CudaSlice<u16>>,
    ) -> Result<(), CudaError> {
        shape(gate_up.len() >= n * 2 * ffn, || "swiglu input".into())?;
        shape(out_f32.as_ref().is_none_or(|o| o.len() >= n * ffn), || {
            "swiglu out".into()
        })?;
        shape(out_bf16.as_ref().is_none_or(|o| o.len() >= n * ffn), || {
            "swiglu out".into()
        })?;
        if n == 0 {
            return Ok(());
        }
        let null = 0u64;
        let f32_ = ffn as u32;
        let mut b = self.stream.launch_builder(self.f("swiglu"));
        b.arg(gate_up).arg(&f32_);
        match out_f32 {
            Some(o) => b.arg(o),
            None => b.arg(&null),
        };
        match out_bf16 {
            Some(o) => b.arg(o),
            None => b.arg(&null),
        };
        // SAFETY: matches `swiglu`; null pointers where allowed.
        drv("launch swiglu", unsafe { b.launch(per_row(n, 256)) }).map(drop)
    }

    /// `out[i] = bf16(x[i])` for `i < n`.
    pub fn to_bf16(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        shape(x.len() >= n && out.len() >= n, || "to_bf16 buffers".into())?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(self.f("to_bf16"));
        b.arg(x).arg(&n64).arg(out);
        // SAFETY: matches `to_bf16`.
        drv("launch to_bf16", unsafe { b.launch(cover(n, 256)) }).map(drop)
    }

    /// Greedy token of each of `n` rows of `logits` (`[n, vocab]`): lowest index on
    /// ties, NaN skipped (as `sampling::argmax`).
    pub fn argmax_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        n: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        shape(logits.len() >= n * vocab && out.len() >= n, || {
            "argmax buffers".into()
        })?;
        if n == 0 {
            return Ok(());
        }
        let v = vocab as u32;
        let mut b = self.stream.launch_builder(self.f("argmax_rows"));
        b.arg(logits).arg(&v).arg(out);
        // SAFETY: matches `argmax_rows` (block of 256: its shared arrays' size).
        drv("launch argmax_rows", unsafe { b.launch(per_row(n, 256)) }).map(drop)
    }

    /// Dequantizes `n_blocks` GGUF blocks of `format` (raw file bytes) into bf16
    /// elements `at..at + n_blocks * 32` of `out` (a row range of a stacked matrix).
    pub fn dequantize(
        &self,
        format: QFormat,
        blocks: &CudaSlice<u8>,
        n_blocks: usize,
        out: &mut CudaSlice<u16>,
        at: usize,
    ) -> Result<(), CudaError> {
        shape(
            blocks.len() >= n_blocks * format.block_bytes() && out.len() >= at + n_blocks * 32,
            || format!("{} dequantize buffers", format.name()),
        )?;
        if n_blocks == 0 {
            return Ok(());
        }
        let (name, per_block) = match format {
            QFormat::Q4_0 => ("dequant_q4_0", 16),
            QFormat::Q4_1 => ("dequant_q4_1", 16),
            QFormat::Q8_0 => ("dequant_q8_0", 32),
            // No device dequantizer: callers dequantize these on the host.
            f @ (QFormat::Q5_0 | QFormat::Q4K | QFormat::Q5K | QFormat::Q6K) => {
                return Err(CudaError::Shape(format!(
                    "{}: no device dequantizer (dequantize on the host)",
                    f.name()
                )))
            }
        };
        let nb = n_blocks as u64;
        let mut view = out.slice_mut(at..at + n_blocks * 32);
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(blocks).arg(&nb).arg(&mut view);
        // SAFETY: matches the dequant kernels' signature; sizes checked.
        drv("launch dequantize", unsafe {
            b.launch(cover(n_blocks * per_block, 256))
        })
        .map(drop)
    }

    /// `y = x . w^T (+ y when accumulate)` through cuBLAS (`cublasGemmEx`, bf16
    /// operands, f32 accumulate and output): `w` bf16 `[out_features, k]`
    /// row-major (a GGUF weight), `x` bf16 `[n, k]`, `y` f32 `[n, out_features]`.
    /// With `accumulate` the residual stream is `y` itself (beta = 1).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16(
        &self,
        w: &CudaSlice<u16>,
        out_features: usize,
        k: usize,
        x: &CudaSlice<u16>,
        n: usize,
        y: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        shape(
            w.len() >= out_features * k && x.len() >= n * k && y.len() >= n * out_features,
            || format!("gemm [{n}, {k}] x [{out_features}, {k}]^T buffers"),
        )?;
        if n == 0 {
            return Ok(());
        }
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        let (wp, _g1) = w.device_ptr(&self.stream);
        let (xp, _g2) = x.device_ptr(&self.stream);
        let yp = self.addr(y);
        // Column-major view: Y^T [out, n] = W [out, k] (stored as k x out, so op T)
        // times X^T [k, n] (stored as k x n, op N).
        // SAFETY: pointers to live buffers of the checked sizes, on the handle's stream.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                out_features as i32,
                n as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                wp as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                xp as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                (&beta as *const f32).cast(),
                yp as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                out_features as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|source| CudaError::Cublas {
            call: "cublasGemmEx",
            source,
        })
    }
}

/// Arguments of [`CudaDevice::paged_attention`].
pub struct AttentionLaunch<'a> {
    /// Queries: row `r`, head `h` at `r * q_stride + h * head_dim` (f32, RoPE applied).
    pub q: &'a CudaSlice<f32>,
    /// Floats per query row.
    pub q_stride: usize,
    /// Output: row `r`, head `h` at `r * out_stride + h * head_dim`.
    pub out: &'a mut CudaSlice<f32>,
    /// Floats per output row.
    pub out_stride: usize,
    /// The pool.
    pub kv: &'a DeviceKv,
    /// The step's rows and block tables.
    pub tables: &'a StepTables,
    /// Layer to read.
    pub layer: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Compare tags (off only to measure what the check costs).
    pub check_tags: bool,
    /// Sliding window (keys `pos + 1 - w..=pos`, as `AttnJob::window` on the
    /// CPU). Not supported by the device kernel yet: `Some` is refused with
    /// [`CudaError::Shape`]; pass `None`.
    pub window: Option<usize>,
}

/// The KV pool in device memory: `pages` pages of [`KvLayout`] bytes (the CPU
/// pool's layout, so page checksums and transfers agree across backends) and the
/// device tag array the kernels check, indexed by physical page.
pub struct DeviceKv {
    layout: KvLayout,
    pages: usize,
    data: CudaSlice<u8>,
    tags: CudaSlice<PageTag>,
    geom: KvGeom,
}

impl std::fmt::Debug for DeviceKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKv")
            .field("layout", &self.layout)
            .field("pages", &self.pages)
            .finish()
    }
}

impl DeviceKv {
    /// A zeroed pool of `pages` pages (every tag the default tag, which no block
    /// table expects: sequence 0 is never allocated).
    pub fn new(dev: &CudaDevice, layout: KvLayout, pages: usize) -> Result<Self, CudaError> {
        shape(pages > 0 && pages <= u32::MAX as usize, || {
            format!("{pages} pages")
        })?;
        Ok(Self {
            data: dev.zeros::<u8>(pages * layout.page_bytes())?,
            tags: dev.zeros::<PageTag>(pages)?,
            geom: KvGeom::new(&layout, pages),
            layout,
            pages,
        })
    }

    /// Page shape.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Pages in the pool.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Device bytes of pages and tags.
    pub fn bytes(&self) -> usize {
        self.pages * (self.layout.page_bytes() + std::mem::size_of::<PageTag>())
    }

    /// Writes `tags[page] = tag` for each pair on the device (the tag write of a
    /// page fill: allocation, landing, a move to the prefix cache, a free).
    pub fn write_tags(
        &mut self,
        dev: &CudaDevice,
        updates: &[(u32, PageTag)],
    ) -> Result<(), CudaError> {
        if updates.is_empty() {
            return Ok(());
        }
        let pages: Vec<u32> = updates.iter().map(|u| u.0).collect();
        let tags: Vec<PageTag> = updates.iter().map(|u| u.1).collect();
        shape(pages.iter().all(|&p| (p as usize) < self.pages), || {
            "tag write outside the pool".into()
        })?;
        let (pd, td) = (dev.upload(&pages)?, dev.upload(&tags)?);
        let (n, np) = (updates.len() as u32, self.pages as u32);
        let mut b = dev.stream.launch_builder(dev.f("write_tags"));
        b.arg(&pd).arg(&td).arg(&n).arg(&mut self.tags).arg(&np);
        // SAFETY: matches `write_tags`; indices checked by the kernel too.
        drv("launch write_tags", unsafe {
            b.launch(cover(updates.len(), 256))
        })
        .map(drop)
    }

    /// The device tag of one page (synchronizes).
    pub fn read_tag(&self, dev: &CudaDevice, page: u32) -> Result<PageTag, CudaError> {
        shape((page as usize) < self.pages, || {
            format!("page {page} of {}", self.pages)
        })?;
        let mut out = [PageTag::default()];
        let p = page as usize;
        drv(
            "cuMemcpyDtoH",
            dev.stream.memcpy_dtoh(&self.tags.slice(p..p + 1), &mut out),
        )?;
        dev.synchronize()?;
        Ok(out[0])
    }

    /// The whole device tag array (synchronizes).
    pub fn read_tags(&self, dev: &CudaDevice) -> Result<Vec<PageTag>, CudaError> {
        dev.download(&self.tags, self.pages)
    }

    /// Whether each `(page, expected)` pair holds on the device (the transfer
    /// source's and sink's check, I3): one flag per pair (synchronizes).
    pub fn verify_tags(
        &self,
        dev: &CudaDevice,
        expected: &[(u32, PageTag)],
    ) -> Result<Vec<bool>, CudaError> {
        if expected.is_empty() {
            return Ok(Vec::new());
        }
        let pages: Vec<u32> = expected.iter().map(|u| u.0).collect();
        let tags: Vec<PageTag> = expected.iter().map(|u| u.1).collect();
        let (pd, td) = (dev.upload(&pages)?, dev.upload(&tags)?);
        let mut bad = dev.zeros::<u32>(expected.len())?;
        let (n, np) = (expected.len() as u32, self.pages as u32);
        let mut b = dev.stream.launch_builder(dev.f("verify_page_tags"));
        b.arg(&pd)
            .arg(&td)
            .arg(&n)
            .arg(&self.tags)
            .arg(&np)
            .arg(&mut bad);
        // SAFETY: matches `verify_page_tags`.
        drv("launch verify_page_tags", unsafe {
            b.launch(cover(expected.len(), 256))
        })?;
        Ok(dev
            .download(&bad, expected.len())?
            .into_iter()
            .map(|b| b == 0)
            .collect())
    }

    /// CRC-32C of each page (the transfer's page checksum, equal to
    /// `transfer::checksum::page_checksum` of the page's bytes; synchronizes).
    pub fn checksums(&self, dev: &CudaDevice, pages: &[u32]) -> Result<Vec<u32>, CudaError> {
        if pages.is_empty() {
            return Ok(Vec::new());
        }
        let pd = dev.upload(pages)?;
        let mut out = dev.zeros::<u32>(pages.len())?;
        let (pb, np) = (self.layout.page_bytes() as u64, self.pages as u32);
        let mut b = dev.stream.launch_builder(dev.f("page_crc32c"));
        b.arg(&self.data).arg(&pb).arg(&pd).arg(&np).arg(&mut out);
        // SAFETY: matches `page_crc32c` (one block of 256 per page).
        drv("launch page_crc32c", unsafe {
            b.launch(per_row(pages.len(), 256))
        })?;
        dev.download(&out, pages.len())
    }

    /// The bytes of one page (a host-staged transfer's source; tests).
    pub fn read_page(&self, dev: &CudaDevice, page: u32) -> Result<Vec<u8>, CudaError> {
        shape((page as usize) < self.pages, || {
            format!("page {page} of {}", self.pages)
        })?;
        let pb = self.layout.page_bytes();
        let at = page as usize * pb;
        let mut out = vec![0u8; pb];
        drv(
            "cuMemcpyDtoH",
            dev.stream
                .memcpy_dtoh(&self.data.slice(at..at + pb), &mut out),
        )?;
        dev.synchronize()?;
        Ok(out)
    }

    /// Writes the bytes of one page (a host-staged transfer landing; tests). The
    /// caller writes the page's tag with [`Self::write_tags`].
    pub fn write_page(
        &mut self,
        dev: &CudaDevice,
        page: u32,
        bytes: &[u8],
    ) -> Result<(), CudaError> {
        let pb = self.layout.page_bytes();
        shape((page as usize) < self.pages && bytes.len() == pb, || {
            format!("page {page} of {} with {} bytes", self.pages, bytes.len())
        })?;
        let at = page as usize * pb;
        let mut view = self.data.slice_mut(at..at + pb);
        drv("cuMemcpyHtoD", dev.stream.memcpy_htod(bytes, &mut view))
    }
}

/// One sequence of a step: its block table (entry `b` names a page that must
/// carry `tag`, with `tag.logical_block == b`, as `verify_tags` checks on the CPU).
#[derive(Clone, Copy, Debug)]
pub struct StepSeq<'a> {
    /// Block table (covering every key the step's rows of this sequence read).
    pub table: &'a [BlockRef],
}

/// One query row of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRow {
    /// Index of the row's sequence in the step's [`StepSeq`] list.
    pub slot: u32,
    /// Position: the row's K/V go to this slot; it attends to keys `0..=pos`.
    pub pos: u32,
}

/// A step packed into 32-bit words: `row_slot[r] row_pos[r] slot_off[s]
/// slot_len[s] tbl_page[e] fail[s]`, padded to 8 bytes, then `tbl_tag[e]` (6 words
/// each: tenant lo, hi, seq lo, hi, epoch, logical block); failure words clear.
struct Packed {
    words: Vec<u32>,
    page_at: usize,
    fail_at: usize,
    tag_at: usize,
}

fn pack(rows: &[StepRow], seqs: &[StepSeq]) -> Packed {
    let s = seqs.len();
    let entries: usize = seqs.iter().map(|q| q.table.len()).sum();
    let mut w: Vec<u32> = Vec::with_capacity(2 * rows.len() + 3 * s + 7 * entries + 1);
    w.extend(rows.iter().map(|x| x.slot));
    w.extend(rows.iter().map(|x| x.pos));
    let mut off = 0u32;
    for q in seqs {
        w.push(off);
        off += q.table.len() as u32;
    }
    w.extend(seqs.iter().map(|q| q.table.len() as u32));
    let page_at = w.len();
    w.extend(seqs.iter().flat_map(|q| q.table.iter().map(|e| e.page)));
    let fail_at = w.len();
    w.extend(std::iter::repeat_n(NO_FAILURE, s));
    if w.len() % 2 == 1 {
        w.push(0);
    }
    let tag_at = w.len();
    for e in seqs.iter().flat_map(|q| q.table.iter()) {
        let t = e.tag;
        w.extend([
            t.tenant as u32,
            (t.tenant >> 32) as u32,
            t.seq as u32,
            (t.seq >> 32) as u32,
            t.epoch,
            t.logical_block,
        ]);
    }
    Packed {
        words: w,
        page_at,
        fail_at,
        tag_at,
    }
}

/// A step's rows, sequences and block tables packed into one device buffer (one
/// copy per step), with the per-sequence failure words the kernels set. Reused
/// across steps; grows when a step needs more.
pub struct StepTables {
    buf: CudaSlice<u32>,
    rows: usize,
    slots: usize,
    fail_at: usize,
    abi: SeqTables,
}

impl std::fmt::Debug for StepTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepTables")
            .field("rows", &self.rows)
            .field("slots", &self.slots)
            .finish()
    }
}

impl StepTables {
    /// Empty tables with room for `capacity` 32-bit words.
    pub fn new(dev: &CudaDevice, capacity: usize) -> Result<Self, CudaError> {
        Ok(Self {
            buf: dev.zeros::<u32>(capacity.max(64))?,
            rows: 0,
            slots: 0,
            fail_at: 0,
            abi: SeqTables::default(),
        })
    }

    /// Rows of the current step.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Uploads a step: `rows` (each naming a sequence of `seqs`) and the
    /// sequences' block tables; every failure word starts clear.
    ///
    /// Errors: [`CudaError::Shape`] when a row names a missing sequence.
    pub fn set(
        &mut self,
        dev: &CudaDevice,
        rows: &[StepRow],
        seqs: &[StepSeq],
    ) -> Result<(), CudaError> {
        let (r, s) = (rows.len(), seqs.len());
        shape(rows.iter().all(|x| (x.slot as usize) < s), || {
            "a row names a sequence outside the step".into()
        })?;
        let Packed {
            words: w,
            page_at,
            fail_at,
            tag_at,
        } = pack(rows, seqs);
        if w.len() > self.buf.len() {
            self.buf = dev.zeros::<u32>(w.len().next_power_of_two())?;
        }
        dev.upload_into(&w, &mut self.buf)?;
        let base = dev.addr(&self.buf);
        let at = |i: usize| base + 4 * i as u64;
        self.abi = SeqTables {
            row_slot: at(0),
            row_pos: at(r),
            slot_off: at(2 * r),
            slot_len: at(2 * r + s),
            tbl_page: at(page_at),
            tbl_tag: at(tag_at),
            slot_fail: at(fail_at),
        };
        self.rows = r;
        self.slots = s;
        self.fail_at = fail_at;
        Ok(())
    }

    /// The device copy of each row's position (for RoPE): the `row_pos` words.
    pub fn positions(&self) -> CudaView<'_, u32> {
        self.buf.slice(self.rows..2 * self.rows)
    }

    /// Per sequence of the step: `None`, or the first logical block whose page
    /// failed a check (reads the failure words back; synchronizes).
    pub fn failures(&self, dev: &CudaDevice) -> Result<Vec<Option<u32>>, CudaError> {
        let mut out = vec![0u32; self.slots];
        if self.slots > 0 {
            drv(
                "cuMemcpyDtoH",
                dev.stream.memcpy_dtoh(
                    &self.buf.slice(self.fail_at..self.fail_at + self.slots),
                    &mut out,
                ),
            )?;
        }
        dev.synchronize()?;
        Ok(out
            .into_iter()
            .map(|f| (f != NO_FAILURE).then_some(f))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_step_decodes_to_its_rows_and_tables() {
        let tag = |seq: u64, lb: u32| PageTag {
            tenant: 0x1_0000_0007,
            seq,
            epoch: 9,
            logical_block: lb,
        };
        let t0 = [
            BlockRef {
                page: 5,
                tag: tag(u64::MAX - 1, 0),
            },
            BlockRef {
                page: 2,
                tag: tag(3, 1),
            },
        ];
        let t1 = [BlockRef {
            page: 7,
            tag: tag(4, 0),
        }];
        let rows = [
            StepRow { slot: 1, pos: 0 },
            StepRow { slot: 0, pos: 17 },
            StepRow { slot: 0, pos: 18 },
        ];
        let p = pack(&rows, &[StepSeq { table: &t0 }, StepSeq { table: &t1 }]);
        let w = &p.words;
        assert_eq!(&w[0..3], &[1, 0, 0]);
        assert_eq!(&w[3..6], &[0, 17, 18]);
        assert_eq!(&w[6..8], &[0, 2]); // slot_off
        assert_eq!(&w[8..10], &[2, 1]); // slot_len
        assert_eq!(p.page_at, 10);
        assert_eq!(&w[10..13], &[5, 2, 7]);
        assert_eq!(p.fail_at, 13);
        assert_eq!(&w[13..15], &[NO_FAILURE, NO_FAILURE]);
        assert_eq!(p.tag_at % 2, 0, "tags are 8-byte aligned");
        let tag_of = |e: usize| {
            let x = &w[p.tag_at + 6 * e..p.tag_at + 6 * e + 6];
            PageTag {
                tenant: x[0] as u64 | (x[1] as u64) << 32,
                seq: x[2] as u64 | (x[3] as u64) << 32,
                epoch: x[4],
                logical_block: x[5],
            }
        };
        assert_eq!(
            [tag_of(0), tag_of(1), tag_of(2)],
            [t0[0].tag, t0[1].tag, t1[0].tag]
        );
        assert_eq!(w.len(), p.tag_at + 18);
    }
}

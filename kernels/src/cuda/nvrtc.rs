//! NVRTC, the CUDA run-time compiler, loaded at run time (no CUDA at build time).
//!
//! Loaded from `TESSERA_NVRTC_LIB` (a file path) when set, else by the usual
//! library names (the dynamic loader's search: `LD_LIBRARY_PATH`, the ld cache),
//! else from `/usr/local/cuda/lib64`. The PyPI wheels `nvidia-cuda-nvrtc` (CUDA 13,
//! `nvidia/cu13/lib/libnvrtc.so.13`) and `nvidia-cuda-nvrtc-cu12`
//! (`nvidia/cuda_nvrtc/lib/libnvrtc.so.12`) carry the library without a toolkit.
//! Only the C API of `nvrtc.h` is used: create a program with the sources and the
//! shared header, compile it for one architecture, read PTX or CUBIN and the log.

use super::sources::{KernelSource, COMMON_HEADER};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

/// Environment variable naming the NVRTC library file to load.
pub const NVRTC_LIB_ENV: &str = "TESSERA_NVRTC_LIB";

/// Library names tried when [`NVRTC_LIB_ENV`] is unset, in order.
pub const NVRTC_NAMES: &[&str] = &[
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "/usr/local/cuda/lib64/libnvrtc.so",
];

/// Why NVRTC could not be loaded or a source did not compile.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    /// No NVRTC library could be opened.
    #[error(
        "NVRTC (libnvrtc, the CUDA run-time compiler) not found: tried {tried}; install the CUDA \
         toolkit or the PyPI wheel nvidia-cuda-nvrtc, or set {NVRTC_LIB_ENV} to libnvrtc.so.*"
    )]
    Missing {
        /// Every candidate with the loader's error.
        tried: String,
    },
    /// The library lacks a function of the NVRTC API.
    #[error("{path} is not a usable NVRTC library: missing symbol {symbol}")]
    Symbol {
        /// Library loaded.
        path: String,
        /// Missing function.
        symbol: &'static str,
    },
    /// An NVRTC call failed.
    #[error("NVRTC {call} failed: {message}")]
    Call {
        /// The API function.
        call: &'static str,
        /// `nvrtcGetErrorString` of the result.
        message: String,
    },
    /// The source did not compile; `log` is NVRTC's program log.
    #[error("NVRTC could not compile {source_name} for {arch}:\n{log}")]
    Compile {
        /// Source file name.
        source_name: &'static str,
        /// Target architecture (`sm_90`, `compute_90`).
        arch: String,
        /// Compiler output.
        log: String,
    },
}

type Program = *mut c_void;
type Res = c_int;

/// The NVRTC functions Tessera calls.
#[derive(Clone, Copy)]
struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Res,
    error_string: unsafe extern "C" fn(Res) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Res,
    destroy: unsafe extern "C" fn(*mut Program) -> Res,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Res,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> Res,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> Res,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Res,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> Res,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> Res,
    log: unsafe extern "C" fn(Program, *mut c_char) -> Res,
}

/// What to compile to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// PTX for a virtual architecture (`compute_XY`): text the driver compiles at load.
    Ptx,
    /// Machine code for a real architecture (`sm_XY`), ptxas included: loads as is.
    Cubin,
}

/// A loaded NVRTC library.
pub struct Nvrtc {
    // Keeps the function pointers of `api` valid.
    _lib: libloading::Library,
    // NVRTC opens its builtins library by name at the first compile; when NVRTC
    // was loaded from a directory the loader does not search (a wheel's), the
    // builtins beside it are opened first, so that by-name open finds them.
    _builtins: Option<libloading::Library>,
    api: Api,
    path: String,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc").field("path", &self.path).finish()
    }
}

impl Nvrtc {
    /// Loads NVRTC from [`NVRTC_LIB_ENV`] if set, else from [`NVRTC_NAMES`].
    ///
    /// Errors: [`NvrtcError::Missing`] naming every candidate tried and why it
    /// failed; [`NvrtcError::Symbol`] for a library without the NVRTC API.
    pub fn load() -> Result<Self, NvrtcError> {
        match std::env::var_os(NVRTC_LIB_ENV) {
            Some(p) => Self::load_path(Path::new(&p)),
            None => {
                let mut tried = Vec::new();
                for name in NVRTC_NAMES {
                    match Self::open(name) {
                        Ok(n) => return Ok(n),
                        Err(NvrtcError::Missing { tried: t }) => tried.push(t),
                        Err(e) => return Err(e),
                    }
                }
                Err(NvrtcError::Missing {
                    tried: tried.join("; "),
                })
            }
        }
    }

    /// Loads NVRTC from one file (for example the PyPI wheel's `libnvrtc.so.13`).
    pub fn load_path(path: &Path) -> Result<Self, NvrtcError> {
        Self::open(&path.display().to_string())
    }

    fn open(name: &str) -> Result<Self, NvrtcError> {
        let builtins = Self::builtins_beside(name);
        // SAFETY: loading NVRTC runs its initializers, which have no preconditions.
        let lib = unsafe { libloading::Library::new(name) }.map_err(|e| NvrtcError::Missing {
            tried: format!("{name} ({e})"),
        })?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is the NVRTC function of that name, whose C
                // signature (nvrtc.h) is the field's type.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|_| {
                    NvrtcError::Symbol {
                        path: name.to_string(),
                        symbol: $name,
                    }
                })?
            };
        }
        let api = Api {
            version: sym!("nvrtcVersion"),
            error_string: sym!("nvrtcGetErrorString"),
            create: sym!("nvrtcCreateProgram"),
            destroy: sym!("nvrtcDestroyProgram"),
            compile: sym!("nvrtcCompileProgram"),
            ptx_size: sym!("nvrtcGetPTXSize"),
            ptx: sym!("nvrtcGetPTX"),
            cubin_size: sym!("nvrtcGetCUBINSize"),
            cubin: sym!("nvrtcGetCUBIN"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
        };
        Ok(Self {
            _lib: lib,
            _builtins: builtins,
            api,
            path: name.to_string(),
        })
    }

    /// `libnvrtc-builtins.so.*` in the directory of `name` (a path), opened.
    fn builtins_beside(name: &str) -> Option<libloading::Library> {
        let dir = Path::new(name)
            .parent()
            .filter(|d| !d.as_os_str().is_empty())?;
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|f| f.to_str())
                    .is_some_and(|f| f.starts_with("libnvrtc-builtins.so."))
            })
            .collect();
        found.sort();
        // SAFETY: as for NVRTC itself.
        found
            .into_iter()
            .find_map(|p| unsafe { libloading::Library::new(&p) }.ok())
    }

    /// Where the library was loaded from (the path or name given to the loader).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NVRTC's (major, minor) version, e.g. (13, 0).
    pub fn version(&self) -> Result<(i32, i32), NvrtcError> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        self.check("nvrtcVersion", unsafe {
            (self.api.version)(&mut major, &mut minor)
        })?;
        Ok((major, minor))
    }

    fn check(&self, call: &'static str, r: Res) -> Result<(), NvrtcError> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static C string for any code.
        let message = unsafe { CStr::from_ptr((self.api.error_string)(r)) }
            .to_string_lossy()
            .into_owned();
        Err(NvrtcError::Call { call, message })
    }

    /// Compiles `src` (with [`COMMON_HEADER`]) for `arch` (`sm_90` for CUBIN,
    /// `compute_90` for PTX) and returns the PTX text (NUL-terminated) or CUBIN bytes.
    ///
    /// Options: C++17, IEEE division and square root, no fast math, FMA contraction
    /// on (NVRTC's default), line info for profilers.
    ///
    /// Errors: [`NvrtcError::Compile`] with the compiler's log; [`NvrtcError::Call`].
    pub fn compile(
        &self,
        src: &KernelSource,
        arch: &str,
        output: Output,
    ) -> Result<Vec<u8>, NvrtcError> {
        self.compile_with(src, arch, output, &[])
            .map(|(image, _)| image)
    }

    /// [`Self::compile`] with `extra` NVRTC options (e.g.
    /// `--ptxas-options=--verbose` for the register and spill report); returns the
    /// image and the compiler's log.
    pub fn compile_with(
        &self,
        src: &KernelSource,
        arch: &str,
        output: Output,
        extra: &[&str],
    ) -> Result<(Vec<u8>, String), NvrtcError> {
        let cstr = |s: &str| CString::new(s).expect("no NUL in sources or options");
        let text = cstr(src.text);
        let name = cstr(src.name);
        let (hname, htext) = (cstr(COMMON_HEADER.0), cstr(COMMON_HEADER.1));
        let headers = [htext.as_ptr()];
        let include_names = [hname.as_ptr()];
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: valid C strings and arrays of one header each, alive for the call.
        self.check("nvrtcCreateProgram", unsafe {
            (self.api.create)(
                &mut prog,
                text.as_ptr(),
                name.as_ptr(),
                1,
                headers.as_ptr(),
                include_names.as_ptr(),
            )
        })?;
        let guard = ProgramGuard {
            api: self.api,
            prog,
        };
        let opts: Vec<CString> = [
            format!("--gpu-architecture={arch}"),
            "--std=c++17".into(),
            "--prec-div=true".into(),
            "--prec-sqrt=true".into(),
            "--generate-line-info".into(),
        ]
        .iter()
        .map(String::as_str)
        .chain(extra.iter().copied())
        .map(cstr)
        .collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: a live program and an array of valid C strings.
        let r =
            unsafe { (self.api.compile)(guard.prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        let log = self.read(
            guard.prog,
            self.api.log_size,
            self.api.log,
            "nvrtcGetProgramLog",
        )?;
        let log = String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .to_string();
        if r != 0 {
            return Err(NvrtcError::Compile {
                source_name: src.name,
                arch: arch.to_string(),
                log,
            });
        }
        let image = match output {
            Output::Ptx => self.read(guard.prog, self.api.ptx_size, self.api.ptx, "nvrtcGetPTX")?,
            Output::Cubin => self.read(
                guard.prog,
                self.api.cubin_size,
                self.api.cubin,
                "nvrtcGetCUBIN",
            )?,
        };
        Ok((image, log))
    }

    fn read(
        &self,
        prog: Program,
        size: unsafe extern "C" fn(Program, *mut usize) -> Res,
        get: unsafe extern "C" fn(Program, *mut c_char) -> Res,
        call: &'static str,
    ) -> Result<Vec<u8>, NvrtcError> {
        let mut n = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        self.check(call, unsafe { size(prog, &mut n) })?;
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds the `n` bytes NVRTC just reported.
        self.check(call, unsafe { get(prog, buf.as_mut_ptr().cast()) })?;
        Ok(buf)
    }
}

/// Destroys an NVRTC program when dropped.
struct ProgramGuard {
    api: Api,
    prog: Program,
}

impl Drop for ProgramGuard {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        unsafe { (self.api.destroy)(&mut self.prog) };
    }
}

/// NVRTC libraries the PyPI wheels install under a Python prefix (a virtual
/// environment such as the tests' `target/py`), newest CUDA first.
pub fn wheel_libraries(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(lib) = std::fs::read_dir(prefix.join("lib")) else {
        return out;
    };
    for py in lib.flatten() {
        let sp = py.path().join("site-packages/nvidia");
        for rel in ["cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.12"] {
            let p = sp.join(rel);
            if p.exists() {
                out.push(p);
            }
        }
    }
    out.sort_by_key(|p| !p.to_string_lossy().contains("cu13"));
    out
}

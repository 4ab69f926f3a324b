//! The instruction set the quantized kernels (dot products, attention, activation
//! quantization) run with, detected once per process. Public as `dot::Isa` and
//! `dot::isa`.

/// Which instruction set the quantized kernels use on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 (F, BW, VL) with VNNI, plus the AVX2 set.
    Avx512Vnni,
}

/// Detects the best supported instruction set once per process.
/// `TESSERA_ISA=scalar|avx2` caps it (for tests and comparisons).
pub fn isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = std::env::var("TESSERA_ISA").unwrap_or_default();
        if cap == "scalar" {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni");
            if avx512 && cap != "avx2" {
                return Isa::Avx512Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

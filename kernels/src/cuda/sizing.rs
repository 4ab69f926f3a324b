//! How large a device KV pool is: a fraction of the device memory that is free
//! once the weights and the step buffers are allocated (vLLM's
//! `gpu_memory_utilization`, applied to what is left rather than to the total, so
//! another process's memory on the same GPU is never counted as ours).

use crate::page::{KvLayout, PageTag};

/// Why no pool size could be derived.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SizingError {
    /// The fraction is not in `(0, 1]`.
    #[error("KV memory fraction must be in (0, 1]. Given: {0}")]
    Fraction(f64),
    /// Not one page fits.
    #[error(
        "{free_bytes} bytes of device memory free, {fraction} of it for the KV pool: not one \
         page of {page_bytes} bytes (plus its {tag_bytes}-byte tag) fits"
    )]
    NoPage {
        /// Free device memory.
        free_bytes: usize,
        /// Fraction asked for.
        fraction: f64,
        /// Bytes of one page.
        page_bytes: usize,
        /// Bytes of one tag.
        tag_bytes: usize,
    },
}

/// Pages of a device KV pool: `floor(free_bytes * fraction / (page_bytes + 24))`,
/// each page with its 24-byte tag in the device tag array; capped at `u32::MAX`
/// pages (block tables hold 32-bit page indices). The pool holds
/// `pages * layout.page_size` tokens, the number I2 is checked against.
///
/// Errors: [`SizingError::Fraction`] outside `(0, 1]`; [`SizingError::NoPage`] when
/// not one page fits.
pub fn pool_pages(
    free_bytes: usize,
    fraction: f64,
    layout: &KvLayout,
) -> Result<usize, SizingError> {
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(SizingError::Fraction(fraction));
    }
    let tag_bytes = std::mem::size_of::<PageTag>();
    let per_page = layout.page_bytes() + tag_bytes;
    let budget = (free_bytes as f64 * fraction).floor() as usize;
    let pages = (budget / per_page).min(u32::MAX as usize);
    if pages == 0 {
        return Err(SizingError::NoPage {
            free_bytes,
            fraction,
            page_bytes: layout.page_bytes(),
            tag_bytes,
        });
    }
    Ok(pages)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm() -> KvLayout {
        KvLayout {
            layers: 30,
            page_size: 16,
            kv_heads: 3,
            head_dim: 64,
        }
    }

    #[test]
    fn pages_are_the_fraction_of_free_memory_over_page_plus_tag() {
        let l = smollm();
        assert_eq!(l.page_bytes(), 288_000);
        // An H200 with 130 GiB free at fraction 0.9.
        let free = 130usize << 30;
        let pages = pool_pages(free, 0.9, &l).unwrap();
        assert_eq!(pages, (free as f64 * 0.9) as usize / (288_000 + 24));
        assert!(pages * (l.page_bytes() + 24) <= (free as f64 * 0.9) as usize);
        assert!((pages + 1) * (l.page_bytes() + 24) > (free as f64 * 0.9) as usize);
        // About 436k pages: 7.0M tokens, far over the 8,192-token context (I2).
        assert!(pages * 16 > 6_900_000);
    }

    #[test]
    fn bad_fractions_and_tiny_memory_are_errors() {
        let l = smollm();
        for f in [0.0, -0.5, 1.01, f64::NAN] {
            assert!(matches!(
                pool_pages(1 << 30, f, &l),
                Err(SizingError::Fraction(_))
            ));
        }
        let e = pool_pages(100_000, 1.0, &l).unwrap_err();
        assert!(matches!(e, SizingError::NoPage { .. }));
        assert!(e.to_string().contains("288000"), "{e}");
        assert_eq!(pool_pages(288_024, 1.0, &l), Ok(1));
    }
}

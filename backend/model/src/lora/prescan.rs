//! A bounded walk of a GGUF header's metadata before the GGUF reader sees it.

/// Most metadata entries, and most elements of one metadata array, an adapter may
/// have (a LoRA file has a handful of scalars and strings).
const MAX_METADATA: u64 = 256;
/// Most bytes of an adapter's metadata section.
const MAX_METADATA_BYTES: usize = 64 << 10;

/// Walks the GGUF header's metadata before the reader does (GGUF spec,
/// ggml/docs/gguf.md: magic, version, tensor count, metadata count, then
/// key-type-value entries), refusing what no LoRA adapter has and what would make
/// the reader allocate far more than the file (it keeps each array element as a
/// 32-byte value): more than [`MAX_METADATA`] entries or array elements, nested
/// arrays, a section over [`MAX_METADATA_BYTES`], or `general.alignment` 0.
pub(super) fn prescan(b: &[u8]) -> Result<(), String> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= b.len().min(MAX_METADATA_BYTES + 24));
        let end = end.ok_or("the header's metadata is truncated or over 64 KiB")?;
        let s = &b[at..end];
        at = end;
        Ok(s)
    };
    let u32_ = |s: &[u8]| u32::from_le_bytes(s.try_into().unwrap());
    let u64_ = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap());
    if b.is_empty() {
        return Err("the file is empty".into());
    }
    if take(4)? != b"GGUF" {
        return Err("not a GGUF file (no GGUF magic)".into());
    }
    let version = u32_(take(4)?);
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version} (2 and 3 are read)"));
    }
    let _tensors = u64_(take(8)?);
    let kvs = u64_(take(8)?);
    if kvs > MAX_METADATA {
        return Err(format!("{kvs} metadata entries (at most {MAX_METADATA})"));
    }
    // Scalar value types' sizes (GGUF type ids 0-12); 8 is a string, 9 an array.
    let size = |t: u32| -> Option<usize> {
        match t {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    };
    for _ in 0..kvs {
        let len = u64_(take(8)?) as usize;
        let key = take(len)?.to_vec();
        let t = u32_(take(4)?);
        match t {
            8 => {
                let len = u64_(take(8)?) as usize;
                take(len)?;
            }
            9 => {
                let et = u32_(take(4)?);
                let n = u64_(take(8)?);
                if n > MAX_METADATA {
                    return Err(format!(
                        "metadata array {:?} has {n} elements (at most {MAX_METADATA})",
                        String::from_utf8_lossy(&key)
                    ));
                }
                for _ in 0..n {
                    match (et, size(et)) {
                        (8, _) => {
                            let len = u64_(take(8)?) as usize;
                            take(len)?;
                        }
                        (_, Some(n)) => {
                            take(n)?;
                        }
                        _ => return Err("a nested or unknown metadata array type".into()),
                    }
                }
            }
            t => {
                let n = size(t).ok_or(format!("metadata value type {t}"))?;
                let v = take(n)?;
                if key == b"general.alignment" && v.iter().all(|&x| x == 0) {
                    return Err("general.alignment is 0".into());
                }
            }
        }
    }
    Ok(())
}

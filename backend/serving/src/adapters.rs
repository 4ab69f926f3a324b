//! LoRA adapters on a node process (issue 38): a request names its fine-tune by id
//! only ([`LoraRef`](tessera_engine::LoraRef) travels without weights), so before
//! the first request under a fine-tune on a link the gateway sends the adapter's
//! file on it, in order, in `Frame::Adapter` chunks of at most
//! [`crate::net::ADAPTER_CHUNK`] bytes. The node checks the file (its SHA-256, then
//! the adapter against its own model, as the gateway checked it at upload), keeps
//! the loaded weights for that link and attaches them to each request on the link
//! that names the fine-tune. A request whose adapter the link did not bring is
//! refused by the engine ([`tessera_engine::Rejection::Lora`]), never run as the
//! base model. Only a gateway identity may send adapters.
//!
//! Each link keeps at most [`MAX_ADAPTERS_PER_LINK`], the least recently used
//! (sent, or named by a request) going first, and the gateway keeps the same list
//! for the link ([`LinkAdapters`], one per side): both see the same sends and
//! requests in the same order, so the gateway knows which adapters the node still
//! has and sends an evicted one again. Links that carry the same file share one
//! copy of its weights.

use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use tessera_engine::GenerateRequest;
use tessera_model::lora::{LoraBase, LoraWeights};
use tessera_model::LoadedModel;

/// Largest adapter file a node takes, bytes.
pub(crate) const MAX_ADAPTER_BYTES: u64 = 512 << 20;
/// Adapters a link keeps (the gateway's list for the link is as long).
pub(crate) const MAX_ADAPTERS_PER_LINK: usize = 16;
/// Adapter files being received at once (over every link); a new one past it
/// drops the oldest.
const MAX_PARTIAL: usize = 4;
/// Longest fine-tune id, bytes.
const MAX_ID_BYTES: usize = 256;

/// The adapters one link holds, most recently used last: `(fine-tune id, file
/// SHA-256)` with a value (the node: the weights; the gateway: nothing).
#[derive(Debug)]
pub(crate) struct LinkAdapters<V> {
    list: Vec<((String, String), V)>,
}

impl<V> Default for LinkAdapters<V> {
    fn default() -> Self {
        Self { list: Vec::new() }
    }
}

impl<V: Clone> LinkAdapters<V> {
    /// The value of `key`, which becomes the most recently used.
    pub(crate) fn touch(&mut self, key: &(String, String)) -> Option<V> {
        let i = self.list.iter().position(|(k, _)| k == key)?;
        let e = self.list.remove(i);
        let v = e.1.clone();
        self.list.push(e);
        Some(v)
    }

    /// The value of fine-tune `id` (any file), which becomes the most recently used.
    fn touch_id(&mut self, id: &str) -> Option<V> {
        let key = self.list.iter().find(|(k, _)| k.0 == id)?.0.clone();
        self.touch(&key)
    }

    /// Adds `key` as the most recently used (replacing the fine-tune's older file),
    /// dropping the least recently used past [`MAX_ADAPTERS_PER_LINK`].
    pub(crate) fn insert(&mut self, key: (String, String), v: V) {
        self.list.retain(|(k, _)| k.0 != key.0);
        self.list.push((key, v));
        if self.list.len() > MAX_ADAPTERS_PER_LINK {
            self.list.remove(0);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.list.len()
    }
}

/// A node's adapters: each link's, and the files being received.
pub(crate) struct NodeAdapters {
    base: Arc<LoraBase>,
    layers: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// By link: its adapters.
    links: HashMap<u64, LinkAdapters<Arc<LoraWeights>>>,
    /// Weights by (fine-tune id, SHA-256), while any link holds them.
    shared: HashMap<(String, String), Weak<LoraWeights>>,
    /// By (link, fine-tune id): the file so far.
    partial: HashMap<(u64, String), Partial>,
    clock: u64,
}

struct Partial {
    sha256: String,
    total: u64,
    bytes: Vec<u8>,
    started: u64,
}

impl NodeAdapters {
    /// Adapters for `model` (what they are checked against).
    pub(crate) fn new(model: &LoadedModel) -> Self {
        Self {
            base: model.lora_base.clone(),
            layers: model.config().layers,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Bytes `offset..offset + chunk.len()` of fine-tune `id`'s file (`total`
    /// bytes, SHA-256 `sha256`) from link `link`; the last chunk checks the file
    /// and gives it to the link. Loading runs on the caller (an adapter of rank <=
    /// 64 loads in milliseconds to tens of milliseconds).
    ///
    /// Errors (the peer broke the protocol; its link is closed): a malformed id or
    /// hash, a size of 0 or over [`MAX_ADAPTER_BYTES`], a chunk out of order or past
    /// the end, a file whose SHA-256 is not the one announced, or an adapter that
    /// does not fit this node's model.
    pub(crate) fn receive(
        &self,
        link: u64,
        id: String,
        sha256: String,
        offset: u64,
        total: u64,
        chunk: &[u8],
    ) -> Result<(), String> {
        if id.is_empty() || id.len() > MAX_ID_BYTES {
            return Err(format!("an adapter id of {} bytes", id.len()));
        }
        if sha256.len() != 64
            || !sha256
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        {
            return Err("an adapter hash that is not 64 lowercase hex digits".into());
        }
        if total == 0 || total > MAX_ADAPTER_BYTES {
            return Err(format!(
                "an adapter of {total} bytes (1 to {MAX_ADAPTER_BYTES})"
            ));
        }
        let mut inner = self.inner.lock().unwrap();
        inner.clock += 1;
        let now = inner.clock;
        let key = (link, id.clone());
        if offset == 0 {
            if inner.partial.len() >= MAX_PARTIAL && !inner.partial.contains_key(&key) {
                let oldest = inner
                    .partial
                    .iter()
                    .min_by_key(|(_, p)| p.started)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    inner.partial.remove(&k);
                }
            }
            inner.partial.insert(
                key.clone(),
                Partial {
                    sha256: sha256.clone(),
                    total,
                    bytes: Vec::new(),
                    started: now,
                },
            );
        }
        let Some(p) = inner.partial.get_mut(&key) else {
            return Err(format!(
                "adapter {id} bytes from {offset} without its start"
            ));
        };
        if p.sha256 != sha256 || p.total != total || p.bytes.len() as u64 != offset {
            return Err(format!("adapter {id} bytes from {offset} out of order"));
        }
        if offset + chunk.len() as u64 > total {
            return Err(format!("adapter {id} bytes past its {total} bytes"));
        }
        p.bytes.extend_from_slice(chunk);
        if (p.bytes.len() as u64) < total {
            return Ok(());
        }
        let p = inner.partial.remove(&key).expect("present above");
        let file = (id.clone(), sha256.clone());
        let known = inner.shared.get(&file).and_then(Weak::upgrade);
        drop(inner);
        let actual = Sha256::digest(&p.bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
        if actual != sha256 {
            return Err(format!(
                "adapter {id} has SHA-256 {actual}, announced {sha256}"
            ));
        }
        let w = match known {
            Some(w) => w,
            None => Arc::new(
                LoraWeights::load(&p.bytes, &self.base, &id, self.layers)
                    .map_err(|e| format!("adapter {id} does not fit this node's model: {e}"))?,
            ),
        };
        let mut inner = self.inner.lock().unwrap();
        inner.shared.retain(|_, w| w.strong_count() > 0);
        inner.shared.insert(file.clone(), Arc::downgrade(&w));
        inner.links.entry(link).or_default().insert(file, w);
        Ok(())
    }

    /// Gives `req`, which came on link `link`, the weights of the fine-tune it
    /// names when the link brought them (else its engine refuses it).
    pub(crate) fn attach(&self, link: u64, req: &mut GenerateRequest) {
        let Some(l) = req.lora.as_mut().filter(|l| l.weights.is_none()) else {
            return;
        };
        let mut inner = self.inner.lock().unwrap();
        if let Some(w) = inner.links.get_mut(&link).and_then(|a| a.touch_id(&l.id)) {
            l.weights = Some(w);
        }
    }

    /// Drops what link `link` sent and was sending (it closed).
    pub(crate) fn forget_link(&self, link: u64) {
        let mut inner = self.inner.lock().unwrap();
        inner.partial.retain(|(l, _), _| *l != link);
        inner.links.remove(&link);
    }

    /// Adapters link `link` holds.
    #[cfg(test)]
    pub(crate) fn held(&self, link: u64) -> usize {
        self.inner
            .lock()
            .unwrap()
            .links
            .get(&link)
            .map_or(0, LinkAdapters::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_engine::LoraRef;
    use tessera_model::testing::{load, lora_file};

    /// A request naming fine-tune `id`, without its weights (as one arrives).
    fn request(id: &str) -> GenerateRequest {
        let mut r = GenerateRequest::new(1, vec![1, 2], 4);
        r.lora = Some(LoraRef {
            id: id.into(),
            weights: None,
            file: None,
        });
        r
    }

    fn sha(b: &[u8]) -> String {
        Sha256::digest(b)
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect()
    }

    #[test]
    fn a_file_in_order_loads_and_attaches_and_anything_else_is_refused() {
        let m = load();
        let a = NodeAdapters::new(&m);
        let file = lora_file(&m, &["attn_q"], 4, 8.0, 0.05, 1);
        let (h, n) = (sha(&file), file.len() as u64);
        let (first, rest) = file.split_at(file.len() / 2);
        let id = || "ft-1".to_string();
        a.receive(1, id(), h.clone(), 0, n, first).unwrap();
        let mut r = request(&id());
        a.attach(1, &mut r);
        assert!(r.lora.as_ref().unwrap().weights.is_none(), "not loaded yet");
        a.receive(1, id(), h.clone(), first.len() as u64, n, rest)
            .unwrap();
        a.attach(1, &mut r);
        assert!(r.lora.as_ref().unwrap().weights.is_some());
        assert_eq!(a.held(1), 1);

        // Out of order, past the end, without a start, a wrong hash, too big.
        a.receive(2, id(), h.clone(), 0, n, first).unwrap();
        let e = a.receive(2, id(), h.clone(), 1, n, rest).unwrap_err();
        assert!(e.contains("out of order"), "{e}");
        let e = a.receive(3, id(), h.clone(), 0, 4, &file[..8]).unwrap_err();
        assert!(e.contains("past"), "{e}");
        let e = a.receive(4, id(), h.clone(), 5, n, rest).unwrap_err();
        assert!(e.contains("without its start"), "{e}");
        let e = a.receive(5, id(), sha(b"x"), 0, n, &file).unwrap_err();
        assert!(e.contains("announced"), "{e}");
        let e = a
            .receive(6, id(), h.to_uppercase(), 0, n, &file)
            .unwrap_err();
        assert!(e.contains("hex"), "{e}");
        let e = a
            .receive(7, id(), h, 0, MAX_ADAPTER_BYTES + 1, &file)
            .unwrap_err();
        assert!(e.contains("bytes"), "{e}");
        // A file that is no adapter of this model, with its own hash.
        let junk = vec![7u8; 64];
        let e = a
            .receive(8, "ft-2".into(), sha(&junk), 0, 64, &junk)
            .unwrap_err();
        assert!(e.contains("does not fit"), "{e}");
        // Another tenant's id that was never sent attaches nothing.
        let mut other = request("ft-2");
        a.attach(1, &mut other);
        assert!(other.lora.unwrap().weights.is_none());
    }

    #[test]
    fn each_link_keeps_its_most_recent_adapters_as_the_gateway_counts_them() {
        let m = load();
        let a = NodeAdapters::new(&m);
        let file = lora_file(&m, &["attn_q"], 2, 4.0, 0.05, 2);
        let (h, n) = (sha(&file), file.len() as u64);
        let mut gateway: LinkAdapters<()> = LinkAdapters::default();
        // Link 1 gets 17 adapters (the same file under 17 ids).
        for i in 0..=MAX_ADAPTERS_PER_LINK {
            let id = format!("ft-{i}");
            a.receive(1, id.clone(), h.clone(), 0, n, &file).unwrap();
            gateway.insert((id.clone(), h.clone()), ());
            if i == 8 {
                // A request names ft-0 half way: it is no longer the oldest.
                let mut r = request("ft-0");
                a.attach(1, &mut r);
                assert!(r.lora.unwrap().weights.is_some());
                assert!(gateway.touch(&("ft-0".into(), h.clone())).is_some());
            }
        }
        assert_eq!(a.held(1), MAX_ADAPTERS_PER_LINK);
        // Both dropped ft-1, the least recently used (ft-0 was named by a request).
        let mut r = request("ft-1");
        a.attach(1, &mut r);
        assert!(r.lora.unwrap().weights.is_none());
        assert!(gateway.touch(&("ft-1".into(), h.clone())).is_none());
        let mut r = request("ft-0");
        a.attach(1, &mut r);
        assert!(r.lora.unwrap().weights.is_some());
        assert!(gateway.touch(&("ft-0".into(), h.clone())).is_some());
        // Another link holds nothing of link 1's; a closed link forgets its own.
        let mut r = request("ft-0");
        a.attach(2, &mut r);
        assert!(r.lora.unwrap().weights.is_none());
        a.forget_link(1);
        assert_eq!(a.held(1), 0);
    }
}

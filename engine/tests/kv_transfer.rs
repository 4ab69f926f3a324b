//! The engine's prefill/decode primitives with the real model and the in-process
//! transport, below the protocol: export (source tag check, zeroed tail, checksums,
//! flush before release), landing (tag check), commit checksums and adoption.
//! A transferred sequence's output must equal its co-located solo output.

use std::sync::{Arc, Mutex};
use tessera_engine::engine::{ExportError, ExportJob, Exported, Import, LandError};
use tessera_engine::testing::*;
use tessera_engine::{Engine, EngineConfig, GenerateRequest};
use tessera_model::LoadedModel;
use tessera_transfer::inproc::{InprocTransport, PageLanding};
use tokio::sync::mpsc::unbounded_channel;

type Landings = Arc<Mutex<Vec<PageLanding>>>;

/// Runs `req`'s prefill on `p` with an export into pages reserved on `d`; returns
/// the decode sequence, what the prefill reported, and the queued landings.
fn prefill_and_export(
    p: &mut Engine,
    d: &mut Engine,
    req: &GenerateRequest,
    transfer: u64,
) -> (
    tessera_model::kv::SeqId,
    Result<Exported, ExportError>,
    Landings,
) {
    let (seq, dest) = d
        .reserve_import(req.tenant, req.prompt.len(), req.max_tokens)
        .unwrap();
    let landings: Landings = Arc::default();
    let sink = landings.clone();
    let result: Arc<Mutex<Option<Result<Exported, ExportError>>>> = Arc::default();
    let out = result.clone();
    p.enqueue_export(
        p.admit(req.clone()).unwrap(),
        ExportJob {
            req: transfer,
            dest,
            transport: Box::new(InprocTransport::new(Box::new(move |l| {
                sink.lock().unwrap().push(l);
                true
            }))),
            done: Box::new(move |r| *out.lock().unwrap() = Some(r)),
        },
    );
    p.run_to_completion();
    let r = result.lock().unwrap().take().expect("export reported");
    (seq, r, landings)
}

fn pd_pair(m: &LoadedModel) -> (Engine, Engine) {
    (
        engine(m, EngineConfig::default()),
        engine(m, EngineConfig::default()),
    )
}

/// Applies the landings on the decode engine, checks every page's checksum against
/// the export, adopts the sequence and decodes it to the end.
fn land_and_decode(
    d: &mut Engine,
    seq: tessera_model::kv::SeqId,
    req: &GenerateRequest,
    exported: &Exported,
    landings: &Landings,
    transfer: u64,
) -> Outcome {
    for l in landings.lock().unwrap().iter() {
        d.land(l).unwrap();
    }
    for (dest, crc) in &exported.pages {
        assert_eq!(d.landed_checksum(*dest), Some(*crc), "page {dest:?}");
    }
    let (sink, mut rx) = unbounded_channel();
    d.adopt(
        seq,
        Import {
            req: d.admit(req.clone()).unwrap(),
            first_token: exported.first_token,
            seed_fallback: transfer,
            rng_word_pos: exported.rng_word_pos,
            sink,
            submitted: std::time::Instant::now(),
        },
    );
    d.run_to_completion();
    drain(&mut rx)
}

#[test]
fn transferred_sequence_decodes_exactly_like_its_colocated_solo_run() {
    let m = load();
    let (mut p, mut d) = pd_pair(&m);
    for (i, text) in [
        "Hi",
        "What is the capital of France?",
        "Explain photosynthesis to a ten year old in two sentences.",
    ]
    .iter()
    .enumerate()
    {
        let req = greedy(chat_prompt(&m, text), 20);
        let alone = solo(&m, req.clone());
        let (seq, exported, landings) = prefill_and_export(&mut p, &mut d, &req, 100 + i as u64);
        assert_eq!(
            p.kv().pool().free_pages(),
            p.kv().pool().capacity(),
            "prefill pages released after the flush"
        );
        let exported = exported.unwrap();
        assert_eq!(exported.tokens, req.prompt.len());
        assert_eq!(exported.pages.len(), req.prompt.len().div_ceil(16));
        let out = land_and_decode(&mut d, seq, &req, &exported, &landings, 100 + i as u64);
        assert_eq!(out, alone, "prompt {text:?}");
        assert_eq!(d.kv().pool().free_pages(), d.kv().pool().capacity());
    }
}

#[test]
fn seeded_sampling_continues_the_same_stream_across_the_transfer() {
    let m = load();
    let (mut p, mut d) = pd_pair(&m);
    let mut req = greedy(chat_prompt(&m, "Write a haiku about the sea."), 16);
    req.sampling.temperature = 0.9;
    req.sampling.seed = Some(7);
    let alone = solo(&m, req.clone());
    let (seq, exported, landings) = prefill_and_export(&mut p, &mut d, &req, 5);
    let out = land_and_decode(&mut d, seq, &req, &exported.unwrap(), &landings, 5);
    assert_eq!(out, alone);
}

#[test]
fn corrupted_landed_byte_changes_the_page_checksum() {
    let m = load();
    let (mut p, mut d) = pd_pair(&m);
    let req = greedy(chat_prompt(&m, "What is 12 times 7?"), 4);
    let (seq, exported, landings) = prefill_and_export(&mut p, &mut d, &req, 1);
    let exported = exported.unwrap();
    let mut landings = std::mem::take(&mut *landings.lock().unwrap());
    landings[1].bytes[1234] ^= 0x40;
    for l in &landings {
        d.land(l).unwrap();
    }
    assert_eq!(
        d.landed_checksum(exported.pages[0].0),
        Some(exported.pages[0].1)
    );
    assert_ne!(
        d.landed_checksum(exported.pages[1].0),
        Some(exported.pages[1].1)
    );
    assert_eq!(
        d.release_seq(seq),
        (req.prompt.len() + req.max_tokens).div_ceil(16)
    );
    assert_eq!(d.kv().pool().free_pages(), d.kv().pool().capacity());
}

#[test]
fn late_landing_after_release_is_dropped_and_leaves_the_new_owner_intact() {
    let m = load();
    let (mut p, mut d) = pd_pair(&m);
    let req = greedy(chat_prompt(&m, "List three primary colors."), 8);
    let (seq, exported, landings) = prefill_and_export(&mut p, &mut d, &req, 1);
    exported.unwrap();
    let late = std::mem::take(&mut *landings.lock().unwrap());
    // The reservation ends (abort acknowledged) before the writes "arrive".
    d.release_seq(seq);
    // A new request from another tenant gets the just-freed pages.
    let mut other = greedy(chat_prompt(&m, "What is the capital of France?"), 12);
    other.tenant = 2;
    let alone = solo(&m, other.clone());
    let mut rx = d.enqueue(d.admit(other).unwrap());
    d.step();
    for l in &late {
        assert_eq!(
            d.land(l),
            Err(LandError::NotReserved { page: l.dest.page }),
            "stale epoch must not validate"
        );
    }
    d.run_to_completion();
    assert_eq!(drain(&mut rx), alone);
    assert_eq!(d.kv().pool().free_pages(), d.kv().pool().capacity());
}

#[test]
fn landing_of_the_wrong_size_is_rejected() {
    let m = load();
    let (mut p, mut d) = pd_pair(&m);
    let req = greedy(chat_prompt(&m, "Hi"), 4);
    let (seq, exported, landings) = prefill_and_export(&mut p, &mut d, &req, 1);
    exported.unwrap();
    let mut l = landings.lock().unwrap().remove(0);
    let want = l.bytes.len();
    l.bytes.pop();
    assert_eq!(
        d.land(&l),
        Err(LandError::WrongSize {
            got: want - 1,
            want
        })
    );
    d.release_seq(seq);
    assert_eq!(d.kv().pool().free_pages(), d.kv().pool().capacity());
}

#[test]
fn export_checks_source_tags_and_descriptor_length() {
    let m = load();
    let (mut p, mut d) = pd_pair(&m);
    let req = greedy(chat_prompt(&m, "What is the capital of France?"), 4);
    // A descriptor one page short.
    let (seq, mut dest) = d
        .reserve_import(req.tenant, req.prompt.len(), req.max_tokens)
        .unwrap();
    dest.pop();
    let result: Arc<Mutex<Option<Result<Exported, ExportError>>>> = Arc::default();
    let out = result.clone();
    p.enqueue_export(
        p.admit(req.clone()).unwrap(),
        ExportJob {
            req: 9,
            dest,
            transport: Box::new(InprocTransport::new(Box::new(|_| {
                panic!("nothing may be written for a bad descriptor")
            }))),
            done: Box::new(move |r| *out.lock().unwrap() = Some(r)),
        },
    );
    p.run_to_completion();
    assert!(matches!(
        result.lock().unwrap().take(),
        Some(Err(ExportError::DescriptorMismatch { .. }))
    ));
    assert_eq!(p.kv().pool().free_pages(), p.kv().pool().capacity());
    d.release_seq(seq);
    assert_eq!(d.kv().pool().free_pages(), d.kv().pool().capacity());
}

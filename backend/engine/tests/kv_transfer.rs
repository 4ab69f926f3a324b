//! The engine's prefill/decode primitives with the real model and the in-process
//! transport, below the protocol: export (source tag check, zeroed tail, checksums,
//! flush before release), landing (tag check), commit checksums and adoption.
//! A transferred sequence's output must equal its co-located solo output.

use std::sync::{Arc, Mutex};
use tessera_engine::kv_transfer::{ExportError, Import, LandError};
use tessera_engine::testing::*;
use tessera_engine::{Engine, EngineConfig, Event, GenerateRequest};
use tessera_model::kv::SeqId;
use tessera_model::LoadedModel;
use tessera_transfer::inproc::PageLanding;
use tessera_transfer::transport::DestPage;
use tokio::sync::mpsc::unbounded_channel;

type Landings = Arc<Mutex<Vec<PageLanding>>>;

/// What a prefill reports for its commit.
#[derive(Debug)]
struct Exported {
    tokens: usize,
    pages: Vec<(DestPage, u32)>,
    first_token: u32,
    rng_word_pos: u128,
}

/// Runs `req`'s prefill on `p` as transfer `transfer` into pages reserved on `d`;
/// returns the decode sequence, what the prefill reported, and the page writes (not
/// yet applied). The source pages are released once the export is copied out, as
/// the protocol does once the writes are drained.
fn prefill_and_export(
    p: &mut Engine,
    d: &mut Engine,
    req: &GenerateRequest,
    transfer: u64,
) -> (SeqId, Result<Exported, ExportError>, Landings) {
    let seq = SeqId(transfer);
    let dest = d
        .reserve_import(seq, req.tenant, req.prompt.len(), req.max_tokens)
        .unwrap();
    p.enqueue_prefill(p.admit(req.clone()).unwrap(), seq);
    p.run_to_completion();
    let done = p.take_prefilled();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].seq, seq);
    let first = done[0].result.clone().expect("prefill computed");
    let landings: Landings = Arc::default();
    let result = p.export_pages(seq, &dest).map(|pages| {
        for pg in &pages {
            landings.lock().unwrap().push(PageLanding {
                req: transfer,
                dest: pg.dest,
                bytes: pg.bytes.clone(),
            });
        }
        Exported {
            tokens: req.prompt.len(),
            pages: pages.iter().map(|pg| (pg.dest, pg.checksum)).collect(),
            first_token: first.token,
            rng_word_pos: first.rng_word_pos,
        }
    });
    assert!(p.release_prefill(seq));
    (seq, result, landings)
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
    seq: SeqId,
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
    let (sink, mut rx) = unbounded_channel::<Event>();
    d.adopt(
        seq,
        Import {
            req: d.admit(req.clone()).unwrap(),
            first_token: exported.first_token,
            seed_fallback: transfer,
            rng_word_pos: exported.rng_word_pos,
            logprobs: None,
            cached_tokens: 0,
            cached_tiers: Default::default(),
            sink: Box::new(sink),
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
fn export_checks_the_descriptor_length_and_holds_nothing_after_release() {
    let m = load();
    let (mut p, mut d) = pd_pair(&m);
    let req = greedy(chat_prompt(&m, "What is the capital of France?"), 4);
    // A descriptor one page short.
    let seq = SeqId(9);
    let mut dest = d
        .reserve_import(seq, req.tenant, req.prompt.len(), req.max_tokens)
        .unwrap();
    dest.pop();
    p.enqueue_prefill(p.admit(req.clone()).unwrap(), seq);
    p.run_to_completion();
    assert!(p.take_prefilled()[0].result.is_ok());
    assert!(matches!(
        p.export_pages(seq, &dest),
        Err(ExportError::DescriptorMismatch { .. })
    ));
    // Held until released (the protocol drains first), then every page is back.
    assert!(p.kv().pool().free_pages() < p.kv().pool().capacity());
    assert!(p.release_prefill(seq));
    assert!(matches!(
        p.export_pages(seq, &dest),
        Err(ExportError::Unknown(_))
    ));
    assert_eq!(p.kv().pool().free_pages(), p.kv().pool().capacity());
    d.release_seq(seq);
    assert_eq!(d.kv().pool().free_pages(), d.kv().pool().capacity());
}

#[test]
fn export_refuses_a_source_page_whose_tag_no_longer_matches() {
    let m = load();
    let (mut p, _) = pd_pair(&m);
    let req = greedy(chat_prompt(&m, "What is the capital of France?"), 4);
    let seq = SeqId(3);
    p.enqueue_prefill(p.admit(req.clone()).unwrap(), seq);
    p.run_to_completion();
    p.take_prefilled();
    // The block table now points its first entry at a page the sequence does not own.
    let table = p.kv_mut_for_test().table_mut_for_test(seq).unwrap();
    table[0].page = (table[0].page + 100) % 1024;
    let dest: Vec<DestPage> = (0..req.prompt.len().div_ceil(16) as u32)
        .map(|page| DestPage {
            page,
            tag: Default::default(),
        })
        .collect();
    assert!(matches!(
        p.export_pages(seq, &dest),
        Err(ExportError::Integrity(_))
    ));
    assert!(p.release_prefill(seq));
    assert_eq!(p.kv().pool().free_pages(), p.kv().pool().capacity());
}

//! Recent integrity events for the operator view (`dash/`): a watcher
//! (`dash::watch_integrity`) samples the integrity counters (KV tag mismatches,
//! refused commits, dropped late writes, node links cut or refused, requests failed
//! on a mismatch) every few seconds and records each
//! increase with its time, so the view lists when they happened, not only how many
//! since start. Counters are what serving keeps (engines and node links count, they
//! do not log events to the gateway); an event is "this counter rose by n between two
//! samples".

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

/// Integrity counters shown: metric family (as exposed, without `_total`), an
/// optional label filter, what it counts, and its runbook.
pub(crate) const INTEGRITY: &[(&str, Option<&str>, &str, &str)] = &[
    (
        "tessera_serve_errors",
        Some("kind=\"integrity\""),
        "Requests failed on a KV tag or checksum mismatch",
        "suspected-cross-tenant-leak",
    ),
    (
        "tessera_kv_tag_mismatches",
        None,
        "KV page reads refused on a tag mismatch",
        "suspected-cross-tenant-leak",
    ),
    (
        "tessera_kv_commits_rejected",
        None,
        "KV transfer commits refused",
        "kv-transfer-integrity",
    ),
    (
        "tessera_kv_late_writes_dropped",
        None,
        "Late KV page writes dropped",
        "kv-transfer-integrity",
    ),
    (
        "tessera_node_link_violations",
        None,
        "Node links cut for a protocol violation",
        "kv-transfer-integrity",
    ),
    (
        "tessera_node_peers_refused",
        None,
        "Node links refused (identity or fingerprint)",
        "pd-deployment",
    ),
];

/// Most events kept (the oldest go first).
const MAX_EVENTS: usize = 100;
/// How often the watcher samples the counters.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// One increase of an integrity counter between two samples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IntegrityEvent {
    /// When the increase was seen (Unix ms).
    pub(crate) at_ms: i64,
    /// Its counter, an index of [`INTEGRITY`].
    pub(crate) counter: usize,
    /// By how much it rose.
    pub(crate) count: u64,
}

/// The gateway's recent integrity events (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct IntegrityLog {
    inner: Mutex<LogState>,
}

#[derive(Debug, Default)]
struct LogState {
    /// The totals of the last sample (none before the first: it sets the baseline).
    last: Option<Vec<u64>>,
    events: VecDeque<IntegrityEvent>,
}

impl IntegrityLog {
    /// Records the counters' `totals` (in [`INTEGRITY`] order) seen at `at_ms`: an
    /// event per counter that rose since the last sample.
    pub(crate) fn observe(&self, totals: Vec<u64>, at_ms: i64) {
        let mut st = self.inner.lock().unwrap();
        if let Some(last) = &st.last {
            let rises: Vec<_> = totals
                .iter()
                .zip(last)
                .enumerate()
                .filter(|(_, (now, then))| now > then)
                .map(|(counter, (now, then))| IntegrityEvent {
                    at_ms,
                    counter,
                    count: now - then,
                })
                .collect();
            for e in rises {
                if st.events.len() == MAX_EVENTS {
                    st.events.pop_front();
                }
                st.events.push_back(e);
            }
        }
        st.last = Some(totals);
    }

    /// The events kept, newest first.
    pub(crate) fn recent(&self) -> Vec<IntegrityEvent> {
        self.inner
            .lock()
            .unwrap()
            .events
            .iter()
            .rev()
            .cloned()
            .collect()
    }
}

/// The integrity counters' totals in `metrics` (OpenMetrics text), in [`INTEGRITY`]
/// order.
pub(crate) fn totals(metrics: &str) -> Vec<u64> {
    INTEGRITY
        .iter()
        .map(|(name, filter, _, _)| metric_sum(metrics, name, *filter))
        .collect()
}

/// Sums of each OpenMetrics family `name` (its `_total` samples, or the gauge's)
/// in `text`, over the samples whose labels contain `filter`.
pub(crate) fn metric_sum(text: &str, name: &str, filter: Option<&str>) -> u64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (family, labels) = match series.split_once('{') {
                Some((f, rest)) => (f, rest),
                None => (series, ""),
            };
            let family = family.strip_suffix("_total").unwrap_or(family);
            (family == name && filter.is_none_or(|f| labels.contains(f)))
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .map(|v| v.max(0.0) as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sums_read_families_and_labels() {
        let text = "# TYPE tessera_kv_tag_mismatches counter\n\
                    tessera_kv_tag_mismatches_total{node=\"a\"} 2\n\
                    tessera_kv_tag_mismatches_total{node=\"b\"} 3\n\
                    tessera_serve_errors_total{kind=\"integrity\"} 1\n\
                    tessera_serve_errors_total{kind=\"engine\"} 7\n\
                    tessera_kv_pages{state=\"quarantined\"} 4\n";
        assert_eq!(metric_sum(text, "tessera_kv_tag_mismatches", None), 5);
        assert_eq!(
            metric_sum(text, "tessera_serve_errors", Some("kind=\"integrity\"")),
            1
        );
        assert_eq!(
            metric_sum(text, "tessera_kv_pages", Some("state=\"quarantined\"")),
            4
        );
        assert_eq!(metric_sum(text, "tessera_kv_commits_rejected", None), 0);
    }

    #[test]
    fn rises_between_samples_are_events_newest_first_and_bounded() {
        let log = IntegrityLog::default();
        let n = INTEGRITY.len();
        let mut t = vec![0u64; n];
        t[1] = 4;
        log.observe(t.clone(), 1); // the baseline: counts from before are not events
        assert!(log.recent().is_empty());
        log.observe(t.clone(), 2);
        assert!(log.recent().is_empty());
        t[1] = 6;
        t[3] = 1;
        log.observe(t.clone(), 3);
        t[0] = 1;
        log.observe(t.clone(), 4);
        let ev: Vec<_> = log
            .recent()
            .iter()
            .map(|e| (e.at_ms, e.counter, e.count))
            .collect();
        assert_eq!(ev, vec![(4, 0, 1), (3, 3, 1), (3, 1, 2)]);
        for i in 0..2 * MAX_EVENTS as u64 {
            t[2] = i + 1;
            log.observe(t.clone(), 10 + i as i64);
        }
        let recent = log.recent();
        assert_eq!(recent.len(), MAX_EVENTS);
        assert_eq!(recent[0].at_ms, 10 + 2 * MAX_EVENTS as i64 - 1);
    }
}

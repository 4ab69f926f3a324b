#![doc = include_str!("../../../../docs/transfer-protocol.md")]

// One module per concept; this file only declares them and re-exports their public
// names (`tessera_transfer::protocol::X`). The machines import the shared types from
// their own modules, never from here.

mod coordinator;
mod decode;
mod flaws;
mod messages;
mod prefill;
mod records;
mod retry;
mod routes;
#[cfg(test)]
mod testkit;
mod wire;

pub use coordinator::{CoordPhase, Coordinator};
pub use decode::{
    verify_commit, DecodeEnv, DecodeNode, DecodeReserveError, DecodeState, PageWrite, Quarantine,
    ReservationAsk,
};
#[cfg(any(test, feature = "test-util"))]
pub use flaws::Flaws;
pub use messages::{
    CommitError, DecodeOutcome, FailKind, FailReason, Failure, Msg, Outcome, Output, PageCommit,
    Refusal, RefusalKind, ReqId, Role,
};
pub use prefill::{AfterDrain, PrefillAsk, PrefillEnv, PrefillNode, PrefillState};
pub use records::{Records, RequestIo, RequestState};
pub use retry::{Attempts, Cause, Retry, RetryPolicy, StreamFence, StreamItem, Writer};
pub use routes::{LinkViolation, RouteBook, Routed};

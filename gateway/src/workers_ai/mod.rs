//! The Workers AI API shape: request parsing ([`parse_run`]) and its response
//! pieces (the `{"result":..,"success":..}` envelope's contents, SSE frames).

mod request;
mod response;

pub use request::parse_run;
pub(crate) use response::*;

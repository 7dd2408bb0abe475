//! # The control plane: configuration, metrics, reconfiguration, HTTP
//!
//! What an operator drives at run time. It sits on the engine and never
//! touches device memory itself.
//!
//! | module | owns |
//! |---|---|
//! | [`config`] | LMCache's `dax` adapter JSON, validated with errors that name the field |
//! | [`metrics`] | the engine's counters in the Prometheus text format |
//! | [`reconfigure`] | the run-time reconfiguration protocol and [`reconfigure::Registry`] |
//! | [`http`] | the HTTP control plane (reconfigure API, `/health`, `/metrics`) |

#![forbid(unsafe_code)]

pub mod config;
pub mod http;
pub mod metrics;
pub mod reconfigure;

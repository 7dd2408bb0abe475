//! # The command line's library half
//!
//! What `daxkv bench`, `daxkv serve` and the client commands do; `main.rs`
//! only parses arguments and dispatches here.
//!
//! | module | owns |
//! |---|---|
//! | [`bench`](mod@bench) | the standard `daxkv bench` workload |
//! | [`serve`] | `daxkv serve`: the engine with its control plane, as a process |
//! | [`soak`] | `daxkv soak`: mixed traffic under hotplug, every key checked |
//! | [`client`] | the control plane's bounded client (`daxkv status \| add \| remove \| resize`) |

// The raw-copy baselines of `bench` copy through the device's own mapping
// (its one `#[allow(unsafe_code)]` function); everything else is safe.
#![deny(unsafe_code)]

pub mod bench;
pub mod client;
pub mod serve;
pub mod soak;

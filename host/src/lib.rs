//! tokwatt: a node agent that runs token-generating GPU work, reads telemetry, and asks a
//! sandboxed WebAssembly policy every control tick which power cap, SM clock and batch
//! size to use.
//!
//! This package is the `tokwatt` binary. Its library holds only the command line's
//! definition ([`cli`]), shared by the binary, its completions and man page, and the tests
//! that parse commands. Everything else lives in the crates under `host/crates/`, which
//! the binary and the end-to-end tests name directly (ARCHITECTURE.md maps them).

pub mod cli;

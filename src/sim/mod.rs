//! Trace simulator.

//! The decode engine every study, `eval` and `bench` share: continuations resumed from KV
//! snapshots and decoded together in batches ([`engine`]), one batch stepped a token at a time
//! in the eager, static or CUDA-graph mode ([`stepper`]), and the batch schedules of a pass
//! ([`schedule`]).
pub mod engine;
pub mod mask_check;
pub mod schedule;
pub mod stats;
pub mod stepper;

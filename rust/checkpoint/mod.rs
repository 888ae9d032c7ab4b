//! Stage 2, activation checkpointing: linearization of the graph into a chain
//! of stages and the rotor dynamic program with communication costs. Serves
//! `automap.checkpoint`.

pub mod linearize;
pub mod rotor;

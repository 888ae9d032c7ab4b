//! The sharding foundation: device meshes and their collective costs, sharding
//! specs and their enumeration, and the layout manager (optimal conversion
//! search with a process-wide cache). Serves `automap.sharding` and the costs of
//! every later stage.

pub mod collective;
pub mod enumerate;
pub mod layout;
pub mod mesh;
pub mod spec;

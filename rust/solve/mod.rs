//! Stage 1, the intra-op search's native parts: strategies generated from op
//! signatures and priced on the mesh, and repeated-block detection. Serves
//! `automap.solve` (the ILP itself is built in Python and solved by HiGHS).

pub mod blocks;
pub mod strategy;

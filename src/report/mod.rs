//! Report plumbing shared by the studies' reports: figures drawn to SVG and PNG.
pub mod figure;

//! devhost library (placeholder)

//! `devhost conformance`: the battery on every bundled module, and modules that crash or hang in it.

mod battery;
mod crashes;

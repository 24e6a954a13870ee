//! What of xtask the tests use as a library: the generators and checks of files the repository
//! keeps (the alert rules' generated files, the Dockerfile) and the host facts both need, so
//! that the tests call the same code the tasks would instead of keeping a copy of their own.

pub mod alerts;
pub mod dockerfile;
pub mod host;

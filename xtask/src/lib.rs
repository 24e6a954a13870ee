//! What of xtask the tests use as a library: the generators and checks of files the repository
//! keeps (the alert rules' generated files, the Dockerfile), the host facts both need and the pods
//! both make (`cni`), so
//! that the tests call the same code the tasks would instead of keeping a copy of their own.

pub mod alerts;
pub mod cni;
pub mod dockerfile;
pub mod host;

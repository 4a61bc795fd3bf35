//! The shared library answers to NCCL's SONAME, so `LD_PRELOAD` and loaders looking for
//! `libnccl.so.2` take it.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
}

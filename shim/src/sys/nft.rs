//! libnftables, loaded at run time: one `nft -f` script per transaction.

use std::ffi::CStr;

/// libnftables (Debian's `libnftables1`, the library the `nft` binary is a
/// front end of), loaded at run time: the same scripts `nft -f` reads, run
/// in the caller's process, without a process spawn each (2-3 ms here,
/// more than a sandbox's whole network set-up otherwise). `None` from
/// [`Nftables::load`] where the library is missing (callers run `nft`).
pub struct Nftables {
    ctx: std::ptr::NonNull<libc::c_void>,
    run: NftRun,
    error: NftBuffer,
    output: NftBuffer,
    free: NftFree,
}

pub(super) type NftNew = unsafe extern "C" fn(u32) -> *mut libc::c_void;

pub(super) type NftSetup = unsafe extern "C" fn(*mut libc::c_void) -> libc::c_int;

pub(super) type NftRun = unsafe extern "C" fn(*mut libc::c_void, *const libc::c_char) -> libc::c_int;

pub(super) type NftBuffer = unsafe extern "C" fn(*mut libc::c_void) -> *const libc::c_char;

pub(super) type NftFree = unsafe extern "C" fn(*mut libc::c_void);

// SAFETY: an nft context is used by one thread at a time (`&mut self`);
// nothing in it is tied to the thread that made it.
unsafe impl Send for Nftables {}

impl Nftables {
    pub fn load() -> Option<Nftables> {
        // SAFETY: dlopen and dlsym take NUL-terminated names; each symbol
        // is cast to the signature libnftables' nftables.h (1.0) declares
        // for it; the handle is never closed, so the symbols stay valid.
        // nft_ctx_new(NFT_CTX_DEFAULT = 0) returns an owned context or
        // NULL; buffering its output and errors makes the run calls print
        // nothing and keep the error text for nft_ctx_get_error_buffer.
        unsafe {
            let lib = libc::dlopen(c"libnftables.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if lib.is_null() {
                return None;
            }
            let sym = |name: &CStr| {
                let p = libc::dlsym(lib, name.as_ptr());
                (!p.is_null()).then_some(p)
            };
            let new = sym(c"nft_ctx_new")?;
            let buffer_output = sym(c"nft_ctx_buffer_output")?;
            let buffer_error = sym(c"nft_ctx_buffer_error")?;
            let run = sym(c"nft_run_cmd_from_buffer")?;
            let error = sym(c"nft_ctx_get_error_buffer")?;
            let output = sym(c"nft_ctx_get_output_buffer")?;
            let free = sym(c"nft_ctx_free")?;
            let new = std::mem::transmute::<*mut libc::c_void, NftNew>(new);
            let buffer = std::mem::transmute::<*mut libc::c_void, NftSetup>(buffer_output);
            let buffer_err = std::mem::transmute::<*mut libc::c_void, NftSetup>(buffer_error);
            let ctx = std::ptr::NonNull::new(new(0))?;
            let nft = Nftables {
                ctx,
                run: std::mem::transmute::<*mut libc::c_void, NftRun>(run),
                error: std::mem::transmute::<*mut libc::c_void, NftBuffer>(error),
                output: std::mem::transmute::<*mut libc::c_void, NftBuffer>(output),
                free: std::mem::transmute::<*mut libc::c_void, NftFree>(free),
            };
            if buffer(ctx.as_ptr()) != 0 || buffer_err(ctx.as_ptr()) != 0 {
                return None;
            }
            Some(nft)
        }
    }

    /// Run `script` (one transaction, as `nft -f`); its error text else.
    pub fn run(&mut self, script: &CStr) -> Result<(), String> {
        // SAFETY: the context is live (freed only by drop) and used by this
        // thread alone; the script is NUL-terminated; the buffers returned
        // are the context's, valid until its next call, and copied at once.
        // Reading a buffer rewinds it, so each run's text is its own.
        unsafe {
            let rc = (self.run)(self.ctx.as_ptr(), script.as_ptr());
            let _ = (self.output)(self.ctx.as_ptr());
            let err = (self.error)(self.ctx.as_ptr());
            let text = if err.is_null() { String::new() } else { CStr::from_ptr(err).to_string_lossy().into_owned() };
            if rc == 0 {
                Ok(())
            } else {
                Err(text)
            }
        }
    }
}

impl Drop for Nftables {
    fn drop(&mut self) {
        // SAFETY: the context came from nft_ctx_new and is freed once.
        unsafe { (self.free)(self.ctx.as_ptr()) }
    }
}

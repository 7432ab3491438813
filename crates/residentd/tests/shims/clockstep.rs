//! A test shim, loaded into residentd with `LD_PRELOAD`, that steps the
//! wall clock of that one process: `CLOCK_REALTIME` (and `gettimeofday`,
//! `time`) read the real clock plus the whole seconds written in the file
//! named by `CLOCKSTEP_FILE` (re-read at every call, so a test steps the
//! clock while the agent runs). Every other clock, the monotonic ones that
//! timers use, passes through untouched. The `e2e` test `clock` compiles it
//! with rustc; it is not part of any crate.

use std::ffi::{c_char, c_int, c_long, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

#[repr(C)]
pub struct Timespec {
    tv_sec: i64,
    tv_nsec: c_long,
}

#[repr(C)]
pub struct Timeval {
    tv_sec: i64,
    tv_usec: c_long,
}

const CLOCK_REALTIME: c_int = 0;
const CLOCK_REALTIME_COARSE: c_int = 5;
/// glibc's RTLD_NEXT: the next object after this one in the search order.
const RTLD_NEXT: *mut c_void = -1isize as *mut c_void;

unsafe extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

type ClockGettime = unsafe extern "C" fn(c_int, *mut Timespec) -> c_int;

static REAL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The offset in seconds; 0 when the file is missing or unreadable.
fn offset() -> i64 {
    let Some(path) = std::env::var_os("CLOCKSTEP_FILE") else {
        return 0;
    };
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn real(clock: c_int, ts: *mut Timespec) -> c_int {
    let mut f = REAL.load(Ordering::Acquire);
    if f.is_null() {
        // SAFETY: a NUL-terminated symbol name; RTLD_NEXT is valid in a
        // shared object loaded by the dynamic linker.
        f = unsafe { dlsym(RTLD_NEXT, c"clock_gettime".as_ptr()) };
        REAL.store(f, Ordering::Release);
    }
    // SAFETY: dlsym found libc's clock_gettime, whose signature this is.
    let f: ClockGettime = unsafe { std::mem::transmute(f) };
    // SAFETY: forwarded as the caller gave it.
    unsafe { f(clock, ts) }
}

/// # Safety
/// As libc's `clock_gettime`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn clock_gettime(clock: c_int, ts: *mut Timespec) -> c_int {
    let rc = real(clock, ts);
    if rc == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE) && !ts.is_null() {
        // SAFETY: the real call just filled it.
        unsafe { (*ts).tv_sec += offset() };
    }
    rc
}

/// # Safety
/// As libc's `gettimeofday`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gettimeofday(tv: *mut Timeval, _tz: *mut c_void) -> c_int {
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer.
    let rc = unsafe { clock_gettime(CLOCK_REALTIME, &mut ts) };
    if rc == 0 && !tv.is_null() {
        // SAFETY: the caller's out pointer, checked for null.
        unsafe {
            (*tv).tv_sec = ts.tv_sec;
            (*tv).tv_usec = ts.tv_nsec / 1000;
        }
    }
    rc
}

/// # Safety
/// As libc's `time`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn time(out: *mut i64) -> i64 {
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer.
    unsafe { clock_gettime(CLOCK_REALTIME, &mut ts) };
    if !out.is_null() {
        // SAFETY: the caller's out pointer, checked for null.
        unsafe { *out = ts.tv_sec };
    }
    ts.tv_sec
}

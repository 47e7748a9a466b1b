//! A thread's scoped choice: a thread-local override set for the length of a call.

/// Run `f` with this thread's choice in `cell` set to `value`; the previous choice is restored
/// after, also when `f` unwinds (the scoped overrides of the sampler and the glue).
pub fn scoped<T: Copy + 'static, R>(
    cell: &'static std::thread::LocalKey<std::cell::Cell<Option<T>>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(
        &'static std::thread::LocalKey<std::cell::Cell<Option<T>>>,
        Option<T>,
    );
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(cell, cell.with(|c| c.replace(Some(value))));
    f()
}

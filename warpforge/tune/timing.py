"""The sweeps' timer: a candidate config run once (compiling it), then timed with do_bench; a config that does not
fit (shared memory, registers) is reported and skipped rather than ending the sweep."""
import triton.testing


def time_candidate(fn, warmup: int = 20, rep: int = 80, graphed: bool = False):
    """Median ms of fn (replayed from a CUDA graph when graphed: for kernels of microseconds, where a launch would be
    most of the time), or None when it raises."""
    try:
        fn()
        if graphed:
            return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    except Exception as exc:  # out of shared memory or registers: not a candidate
        print(f"    {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None

/* LD_PRELOAD helper for device probes (no gdb there): on SIGSEGV/SIGABRT print
 * the native backtrace of the crashing thread to stderr, then die.
 *   gcc -shared -fPIC -o /tmp/segv.so notes/segv_backtrace.c
 *   LD_PRELOAD=/tmp/segv.so python3 notes/probe_check_finite.py          */
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int sig) {
  void* frames[96];
  const char msg[] = "\n*** native backtrace (segv_backtrace.c) ***\n";
  write(2, msg, sizeof msg - 1);
  int n = backtrace(frames, 96);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
}

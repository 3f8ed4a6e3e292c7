/* A SIGSEGV/SIGBUS/SIGABRT handler that prints the native backtrace (dynamic symbol names) to
 * stderr, preloaded into a process that dies without one (the GPU machine has no gdb): the PyTorch
 * operator's crash of session 15 (python/tests, H100) is the first use.
 *   gcc -shared -fPIC -O1 scripts/segv-backtrace.c -o segv-backtrace.so        (here)
 *   LD_PRELOAD=$PWD/segv-backtrace.so python3 -m pytest ...                     (there)
 * This constructor runs before the interpreter starts; Python's faulthandler (pytest enables it)
 * installs its handler later, prints the Python frames, restores this one and re-raises: this one
 * then prints the native frames and ends the process with the default action. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig, siginfo_t* info, void* ctx) {
  (void)ctx;
  void* frames[64];
  char msg[96];
  int n = backtrace(frames, 64);
  const char* name = sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : "SIGABRT";
  int len = 0;
  const char* p = "segv-backtrace: ";
  while (p[len]) len++;
  write(2, p, (size_t)len);
  write(2, name, strlen(name));
  /* The faulting address, in hex, without printf (not async-signal-safe). */
  unsigned long a = (unsigned long)info->si_addr;
  int i = 0;
  msg[i++] = ' ';
  msg[i++] = 'a';
  msg[i++] = 't';
  msg[i++] = ' ';
  msg[i++] = '0';
  msg[i++] = 'x';
  for (int s = 60; s >= 0; s -= 4) msg[i++] = "0123456789abcdef"[(a >> s) & 0xF];
  msg[i++] = '\n';
  write(2, msg, (size_t)i);
  backtrace_symbols_fd(frames, n, 2);
  /* Back to the default action, which ends the process. */
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  /* backtrace() loads the unwinder (dlopen, malloc) on its first call: not in the handler. */
  void* warm[1];
  backtrace(warm, 1);
  /* An alternate stack, so that a stack overflow still gets its backtrace. */
  static char alt[1 << 16];
  stack_t ss;
  memset(&ss, 0, sizeof ss);
  ss.ss_sp = alt;
  ss.ss_size = sizeof alt;
  sigaltstack(&ss, 0);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
  sigaction(SIGABRT, &sa, 0);
}

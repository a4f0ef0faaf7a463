/* Parts of a warm exec's cost, measured without Strata (scripts/bench-exec-parts.sh).
 *
 *   exec_parts spawn BINARY N     fork+exec+wait of `BINARY true` N times, as
 *                                 a bare posix_spawn does it and as the shim's
 *                                 child does (setsid, stdio, close_range, signal
 *                                 mask, chdir, credentials, dumpable, a PATH
 *                                 search through five missing directories),
 *                                 ten of each kind in turn
 *   exec_parts pingpong N GAP_US  one byte there and back between two
 *                                 processes over a Unix socket pair, GAP_US
 *                                 idle before each
 *
 * Prints medians and deciles in ms (spawn) or µs (pingpong). Static, so
 * that it runs inside a sandbox of any image. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *binary;
static int shim_like;
static char *const child_argv[] = {"true", NULL};
static char *const child_envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", NULL};

static int child(void *unused) {
	(void)unused;
	if (shim_like) {
		static const char *missing[] = {"/usr/local/sbin/nope", "/usr/local/bin/nope", "/usr/sbin/nope",
						"/usr/bin/nope", "/sbin/nope"};
		sigset_t none;
		setsid();
		for (int fd = 0; fd < 3; fd++)
			dup2(fd, fd);
		syscall(SYS_close_range, 3, ~0U, 4 /* CLOSE_RANGE_CLOEXEC */);
		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
		signal(SIGPIPE, SIG_DFL);
		if (chdir("/") != 0)
			_exit(126);
		gid_t g = getgid();
		if (setgroups(1, &g) != 0 || setgid(g) != 0 || setuid(getuid()) != 0)
			_exit(126);
		prctl(PR_SET_DUMPABLE, 0);
		for (unsigned i = 0; i < sizeof missing / sizeof *missing; i++)
			execve(missing[i], child_argv, child_envp);
	}
	execve(binary, child_argv, child_envp);
	_exit(127);
}

static double now_us(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static void report(const char *what, double *v, int n, double scale, const char *unit) {
	qsort(v, n, sizeof *v, cmp);
	printf("%-44s p50 %8.3f  p10 %8.3f  p90 %8.3f %s\n", what, v[n / 2] / scale, v[n / 10] / scale,
	       v[9 * n / 10] / scale, unit);
}

static int spawn(int n) {
	static char stack[256 * 1024];
	double *t[2] = {calloc(n, sizeof(double)), calloc(n, sizeof(double))};
	for (int i = 0; i < n; i += 10)
		for (int kind = 0; kind < 2; kind++) {
			shim_like = kind;
			for (int j = i; j < i + 10 && j < n; j++) {
				double t0 = now_us();
				int st, pid = clone(child, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD, NULL);
				if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
					fprintf(stderr, "spawn of %s failed\n", binary);
					return 1;
				}
				t[kind][j] = now_us() - t0;
			}
		}
	report("fork+exec+wait, bare", t[0], n, 1e3, "ms");
	report("fork+exec+wait, the shim child's steps", t[1], n, 1e3, "ms");
	return 0;
}

static int pingpong(int n, int gap) {
	int sv[2];
	char c = 'x';
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
		return 1;
	pid_t pid = fork();
	if (pid == 0) {
		close(sv[0]);
		while (read(sv[1], &c, 1) == 1)
			if (write(sv[1], &c, 1) != 1)
				break;
		_exit(0);
	}
	close(sv[1]);
	double *t = calloc(n, sizeof(double));
	for (int i = 0; i < n; i++) {
		if (gap)
			usleep(gap);
		double t0 = now_us();
		if (write(sv[0], &c, 1) != 1 || read(sv[0], &c, 1) != 1)
			return 1;
		t[i] = now_us() - t0;
	}
	close(sv[0]);
	waitpid(pid, NULL, 0);
	char what[64];
	snprintf(what, sizeof what, "Unix socket round trip, %d us idle before", gap);
	report(what, t, n, 1, "us");
	return 0;
}

int main(int argc, char **argv) {
	if (argc == 4 && strcmp(argv[1], "spawn") == 0) {
		binary = argv[2];
		return spawn(atoi(argv[3]));
	}
	if (argc == 4 && strcmp(argv[1], "pingpong") == 0)
		return pingpong(atoi(argv[2]), atoi(argv[3]));
	fprintf(stderr, "usage: exec_parts spawn BINARY N | exec_parts pingpong N GAP_US\n");
	return 2;
}

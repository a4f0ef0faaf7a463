/* netb: TCP connect latency and throughput, for scripts/bench-network.sh.
 * Static, so it runs in a busybox sandbox as on the host.
 *
 *   netb serve PORT              accept forever: read and drop until EOF
 *   netb connect IP PORT COUNT   COUNT connect+close; prints p50 p90 in ms
 *   netb send IP PORT SECONDS    one connection, send for SECONDS; prints MB/s
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static int dial(const char *ip, int port) {
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	inet_pton(AF_INET, ip, &a.sin_addr);
	int s = socket(AF_INET, SOCK_STREAM, 0);
	if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) < 0) {
		perror("connect");
		exit(1);
	}
	return s;
}

static int cmp(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

int main(int argc, char **argv) {
	static char buf[1 << 17];
	if (argc == 3 && !strcmp(argv[1], "serve")) {
		struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
		int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
		setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
		if (bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 512) < 0) {
			perror("listen");
			return 1;
		}
		for (;;) {
			int c = accept(l, NULL, NULL);
			if (c < 0)
				continue;
			if (fork() == 0) {
				while (read(c, buf, sizeof buf) > 0)
					;
				_exit(0);
			}
			close(c);
			while (waitpid(-1, NULL, WNOHANG) > 0)
				;
		}
	}
	if (argc == 5 && !strcmp(argv[1], "connect")) {
		int n = atoi(argv[4]);
		double *v = calloc(n, sizeof *v);
		for (int i = 0; i < n; i++) {
			double t = now();
			close(dial(argv[2], atoi(argv[3])));
			v[i] = (now() - t) * 1e3;
		}
		qsort(v, n, sizeof *v, cmp);
		printf("%.3f %.3f\n", v[n / 2], v[(n * 9) / 10]);
		return 0;
	}
	if (argc == 5 && !strcmp(argv[1], "send")) {
		int s = dial(argv[2], atoi(argv[3]));
		double t = now(), end = t + atof(argv[4]);
		long long sent = 0;
		while (now() < end) {
			ssize_t w = write(s, buf, sizeof buf);
			if (w <= 0) {
				perror("write");
				return 1;
			}
			sent += w;
		}
		printf("%.1f\n", sent / (now() - t) / 1e6);
		return 0;
	}
	fprintf(stderr, "usage: netb serve PORT | connect IP PORT COUNT | send IP PORT SECONDS\n");
	return 2;
}

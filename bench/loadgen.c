/* A constant-rate HTTP/1.1 load generator (wrk2-style): requests are due on
 * a fixed schedule, request i at start + i/RATE, and each latency is counted
 * from the request's due time, not from when it was sent, so a stalled
 * server is charged for the requests it held back (no coordinated omission).
 *
 *   loadgen HOST PORT PATH RATE SECONDS CONNECTIONS WARMUP OUTFILE [close]
 *
 * CONNECTIONS keep-alive connections; a due request goes out on a free one
 * at once, or waits (its clock running) for the first that frees. With
 * `close`, each request is made on a new connection (dialled when the
 * request goes out, its connect counted in its latency; the request says
 * Connection: close, so the server closes first, as a web server does): a
 * slot is then one connection at a time. Requests
 * due in the first WARMUP seconds are sent but not recorded. Latencies of
 * the recorded requests go to OUTFILE as float64 microseconds, in order of
 * completion. Prints one line:
 *
 *   due N done N errors E seconds S rate R late_max_us L
 *
 * (late_max_us: the longest a due request waited for a free connection).
 * Built by bench/overhead.py with `cc -O2`.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

struct conn {
	int fd;
	int busy;
	long idx;            /* the request in flight: its number */
	double due;          /* and its due time */
	size_t have;         /* response bytes read */
	long need;           /* total response bytes, once the header is in; -1 before */
	char buf[65536];
};

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static struct sockaddr_in addr;
static char req[1024];
static int reqlen;
static int close_mode;

static int dial(void)
{
	int s = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	if (connect(s, (struct sockaddr *)&addr, sizeof addr)) {
		perror("loadgen: connect");
		exit(1);
	}
	return s;
}

/* Length of a whole response once its header is in buf, -1 while incomplete. */
static long response_len(const char *b, size_t n)
{
	const char *end = memmem(b, n, "\r\n\r\n", 4);
	if (!end)
		return -1;
	long body = 0;
	const char *cl = memmem(b, end - b, "\r\nContent-Length:", 17);
	if (!cl)
		cl = memmem(b, end - b, "\r\ncontent-length:", 17);
	if (cl)
		body = atol(cl + 17);
	return (end - b) + 4 + body;
}

int main(int argc, char **argv)
{
	if (argc != 9 && !(argc == 10 && !strcmp(argv[9], "close"))) {
		fprintf(stderr, "usage: %s HOST PORT PATH RATE SECONDS CONNECTIONS WARMUP OUTFILE [close]\n", argv[0]);
		return 2;
	}
	addr.sin_family = AF_INET;
	addr.sin_port = htons(atoi(argv[2]));
	inet_pton(AF_INET, argv[1], &addr.sin_addr);
	double rate = atof(argv[4]), seconds = atof(argv[5]), warmup = atof(argv[7]);
	int nconn = atoi(argv[6]);
	if (rate <= 0 || seconds <= 0 || nconn <= 0 || nconn > 4096) {
		fprintf(stderr, "loadgen: bad arguments\n");
		return 2;
	}
	close_mode = argc == 10;
	reqlen = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: %s:%s\r\nUser-Agent: nettap-loadgen\r\n%s\r\n",
			  argv[3], argv[1], argv[2], close_mode ? "Connection: close\r\n" : "");
	FILE *out = fopen(argv[8], "wb");
	if (!out) {
		perror("loadgen: output");
		return 1;
	}

	long total = (long)((warmup + seconds) * rate), skip = (long)(warmup * rate);
	double *lat = malloc(sizeof(double) * (total + 1));
	long *queue = malloc(sizeof(long) * (total + 1));       /* due requests waiting for a connection */
	long qhead = 0, qtail = 0, ndone = 0, nrec = 0, errors = 0, next = 0;
	double late_max = 0;

	int ep = epoll_create1(0);
	struct conn *c = calloc(nconn, sizeof *c);
	for (int i = 0; i < nconn; i++) {
		c[i].fd = -1;
		if (close_mode)
			continue;
		c[i].fd = dial();
		struct epoll_event ev = {.events = EPOLLIN, .data.u32 = i};
		epoll_ctl(ep, EPOLL_CTL_ADD, c[i].fd, &ev);
	}
	int tfd = timerfd_create(CLOCK_MONOTONIC, 0);
	struct epoll_event tev = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
	epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &tev);

	double start = now() + 0.01;
	int armed = 0;
	while (ndone < total) {
		double t = now();
		if (t > start + total / rate + 30) {      /* answers that never came: errors */
			errors += total - ndone;
			break;
		}
		/* due requests join the queue */
		while (next < total && start + next / rate <= t)
			queue[qtail++] = next++;
		/* queued requests go out on free connections */
		for (int i = 0; i < nconn && qhead < qtail; i++) {
			if (c[i].busy)
				continue;
			long idx = queue[qhead++];
			double due = start + idx / rate;
			if (t - due > late_max)
				late_max = t - due;
			if (c[i].fd < 0) {       /* close mode: a new connection for this request */
				c[i].fd = dial();
				struct epoll_event ev = {.events = EPOLLIN, .data.u32 = i};
				epoll_ctl(ep, EPOLL_CTL_ADD, c[i].fd, &ev);
			}
			if (write(c[i].fd, req, reqlen) != reqlen) {
				errors++;
				ndone++;
				continue;
			}
			c[i].busy = 1;
			c[i].idx = idx;
			c[i].due = due;
			c[i].have = 0;
			c[i].need = -1;
		}
		if (next < total && !armed) {
			double d = start + next / rate;
			struct itimerspec its = {.it_value = {.tv_sec = (time_t)d, .tv_nsec = (long)((d - (time_t)d) * 1e9)}};
			if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0)
				its.it_value.tv_nsec = 1;
			timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
			armed = 1;
		}
		struct epoll_event evs[64];
		int n = epoll_wait(ep, evs, 64, 1000);
		for (int k = 0; k < n; k++) {
			uint32_t i = evs[k].data.u32;
			if (i == UINT32_MAX) {
				uint64_t x;
				ssize_t rd = read(tfd, &x, sizeof x);
				(void)rd;
				armed = 0;
				continue;
			}
			struct conn *q = &c[i];
			ssize_t r = read(q->fd, q->buf + q->have, sizeof q->buf - q->have);
			if (r <= 0) {            /* the server closed: count an error, dial again */
				epoll_ctl(ep, EPOLL_CTL_DEL, q->fd, NULL);
				close(q->fd);
				q->fd = -1;
				if (close_mode && q->busy == 2) {
					q->busy = 0;    /* its answer was whole: the next request dials */
					continue;
				}
				if (close_mode) {
					if (q->busy)
						errors++, ndone++;
					q->busy = 0;
					continue;
				}
				q->fd = dial();
				struct epoll_event ev = {.events = EPOLLIN, .data.u32 = i};
				epoll_ctl(ep, EPOLL_CTL_ADD, q->fd, &ev);
				if (q->busy) {
					errors++;
					ndone++;
					q->busy = 0;
				}
				continue;
			}
			q->have += r;
			if (q->need < 0)
				q->need = response_len(q->buf, q->have);
			if (q->need >= 0 && (long)q->have >= q->need) {
				double done = now();
				if (q->idx >= skip)
					lat[nrec++] = (done - q->due) * 1e6;
				ndone++;
				q->busy = close_mode ? 2 : 0;   /* close: free once the server's FIN is read */
				q->have = 0;
				if (strncmp(q->buf, "HTTP/1.1 200", 12))
					errors++;
			} else if (q->have == sizeof q->buf) {
				fprintf(stderr, "loadgen: response larger than %zu bytes\n", sizeof q->buf);
				return 1;
			}
		}
	}
	double elapsed = now() - (start + skip / rate);
	fwrite(lat, sizeof(double), nrec, out);
	fclose(out);
	printf("due %ld done %ld errors %ld seconds %.3f rate %.1f late_max_us %.0f\n", total - skip, nrec, errors,
	       elapsed, nrec / elapsed, late_max * 1e6);
	return 0;
}

/* The TCP prober's storm: short loopback TCP connections, each one
 * connect, send 64 bytes, the server echoes 64 bytes, close.
 *
 *   storm PORT CONNECTIONS THREADS [BYTES]
 *
 * One round: a server (THREADS accepting threads, in this process) listens on
 * 127.0.0.1:PORT, and THREADS client threads open CONNECTIONS connections in
 * all, one after another each, sending BYTES (64) bytes that the server echoes.
 * The server closes first (read BYTES, write BYTES, close), so TIME_WAIT stays on the server's side and the clients' ephemeral
 * ports are free again at once; the client reads the echo, then the server's
 * FIN, then closes. Prints one line:
 *
 *   connections N seconds S rate R errors E
 *
 * (rate: connections a second, from the first connect to the last close).
 * Built by bench/storm_c.py with `cc -O2 -pthread`.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAXMSG (1 << 20)

static struct sockaddr_in addr;
static int lfd;
static long per_thread, extra;
static int msglen = 64;
static atomic_long errors, served;
static pthread_barrier_t start;

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int full(int fd, char *buf, int n, int writing)
{
	int done = 0;
	while (done < n) {
		ssize_t r = writing ? write(fd, buf + done, n - done) : read(fd, buf + done, n - done);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		done += r;
	}
	return 0;
}

static void *server(void *arg)
{
	char *buf = malloc(msglen);
	(void)arg;
	for (;;) {
		int c = accept(lfd, NULL, NULL);
		if (c < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			free(buf);
			return NULL;          /* the listening socket was shut down */
		}
		if (full(c, buf, msglen, 0) || full(c, buf, msglen, 1))
			atomic_fetch_add(&errors, 1);
		close(c);
		atomic_fetch_add(&served, 1);
	}
}

static void *client(void *arg)
{
	long n = per_thread + ((long)arg < extra);
	char *msg = malloc(msglen), *buf = malloc(msglen);
	memset(msg, 'x', msglen);
	pthread_barrier_wait(&start);
	for (long i = 0; i < n; i++) {
		int s = socket(AF_INET, SOCK_STREAM, 0);
		int one = 1;
		setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
		if (connect(s, (struct sockaddr *)&addr, sizeof addr) || full(s, msg, msglen, 1) ||
		    full(s, buf, msglen, 0) || read(s, buf, 1) != 0)     /* the echo, then the server's FIN */
			atomic_fetch_add(&errors, 1);
		close(s);
	}
	pthread_barrier_wait(&start);
	free(msg);
	free(buf);
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 4 && argc != 5) {
		fprintf(stderr, "usage: %s PORT CONNECTIONS THREADS [BYTES]\n", argv[0]);
		return 2;
	}
	int port = atoi(argv[1]);
	long conns = atol(argv[2]);
	int threads = atoi(argv[3]);
	if (argc == 5)
		msglen = atoi(argv[4]);
	if (port <= 0 || port > 65535 || conns <= 0 || threads <= 0 || threads > 256 || msglen <= 0 ||
	    msglen > MAXMSG) {
		fprintf(stderr, "storm: bad arguments\n");
		return 2;
	}
	per_thread = conns / threads;
	extra = conns % threads;

	addr.sin_family = AF_INET;
	addr.sin_port = htons(port);
	addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	lfd = socket(AF_INET, SOCK_STREAM, 0);
	int one = 1;
	setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) || listen(lfd, 4096)) {
		perror("storm: bind/listen");
		return 1;
	}

	pthread_t srv[256], cli[256];
	for (int i = 0; i < threads; i++)
		pthread_create(&srv[i], NULL, server, NULL);
	pthread_barrier_init(&start, NULL, threads + 1);
	for (long i = 0; i < threads; i++)
		pthread_create(&cli[i], NULL, client, (void *)i);

	pthread_barrier_wait(&start);
	double t0 = now();
	pthread_barrier_wait(&start);
	double t = now() - t0;
	for (int i = 0; i < threads; i++)
		pthread_join(cli[i], NULL);
	/* every connection was served: the client read the server's FIN */
	shutdown(lfd, SHUT_RDWR);
	for (int i = 0; i < threads; i++)
		pthread_join(srv[i], NULL);
	close(lfd);
	printf("connections %ld seconds %.6f rate %.1f errors %ld\n", conns, t, conns / t,
	       (long)atomic_load(&errors));
	return atomic_load(&errors) ? 1 : 0;
}

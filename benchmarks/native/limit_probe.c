/* limit_probe: ceilings of the kernel's socket path, and a native netagg load generator.
 *
 *   udp-reflect --bind IP:PORT [--netagg] [--gro]  echo every datagram to its source
 *   udp-client  --target IP:PORT [--size 280] [--window 64] [--seconds 2] [--gso]
 *   raw-reflect --ifname IF [--netagg]             AF_PACKET: swap the MACs, send the frame back
 *   raw-client  --ifname IF [--size 322] [--window 64] [--seconds 2]
 *   netagg-drive --workers W --slots S [--job 1] [--seconds T | --rounds R] [--rto-ms 20]
 *       --udp --target IP:PORT --bind-ports p1,p2,... [--gso]
 *     | --raw --ifnames if1,... --src-ips ip1,... --src-macs mac1,... --dst-ip IP --dst-mac MAC
 *       [--udp-src-base 40000]
 *
 * netagg-drive resends a contribution's same bytes when its result is late: after max(--rto-ms, 4 x the
 * smoothed round trip of contributions sent once), so a slow switch is not mistaken for a lossy one.
 * Reflectors print "listening ..." on stderr when ready, run until SIGTERM/SIGINT and then
 * print their counts; every command prints one JSON line with its result on stdout.
 * --netagg sets the RESULT flag (byte 1 |= 0x01) of the netagg header before echoing.
 *
 * Per-datagram modes (the default) move one datagram per message with sendmmsg/recvmmsg, 64 a call.
 * --gso/--gro use UDP GSO and GRO instead: a send is one UDP_SEGMENT message of up to 64 equal-size
 * segments (header + segment <= the route's MTU; the device needs tx checksumming), and a UDP_GRO socket
 * receives coalesced buffers with a SOL_UDP/UDP_GRO cmsg holding the segment size (absent: one datagram),
 * split here by it (the last segment may be shorter). udp-reflect --gro echoes each coalesced buffer with
 * one UDP_SEGMENT send of the same segment size (RESULT set in every segment with --netagg);
 * udp-client --gso sends its window that way and receives with UDP_GRO; netagg-drive --udp --gso sends
 * each worker's queued contributions as one UDP_SEGMENT send and receives results with UDP_GRO.
 * The clients stamp a sequence number and a hash of it into every payload of >= 16 bytes and check them
 * (and the fill bytes) in the echo, so a corrupting kernel shows as payload_errors, not a silent figure.
 * Every command reports datagrams per send/receive system call (datagrams_per_send/_receive).
 * Wire format: netagg/wire.py. C11, libc and Linux headers only.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef PACKET_IGNORE_OUTGOING
#define PACKET_IGNORE_OUTGOING 23
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

enum { BATCH = 64, BUF = 2048, K = 64, NETAGG_VERSION = 4, NETAGG_HDR = 24, NETAGG_BYTES = NETAGG_HDR + 4 * K,
       L2L4 = 14 + 20 + 8, NETAGG_PORT = 28900, MAX_WORKERS = 32, FLAG_RESULT = 0x01,
       GSO_MAX_SEGS = 64, UDP_MAX_PAYLOAD = 65535 - 20 - 8, GRO_BATCH = 8, GRO_BUF = 65536, FILL = 0x5a };

/* System calls that moved data (sendmmsg/sendmsg, recvmmsg that returned messages). */
static uint64_t send_calls, receive_calls;
static int gso_sends; /* for the error message of a failed UDP_SEGMENT send */

static volatile sig_atomic_t stop_flag;
static void on_signal(int sig) { (void)sig; stop_flag = 1; }

static void die(const char *what) {
    fprintf(stderr, "limit_probe: %s%s%s\n", what, errno ? ": " : "", errno ? strerror(errno) : "");
    exit(2);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

/* --name VALUE from argv, or dflt. */
static const char *opt(int argc, char **argv, const char *name, const char *dflt) {
    for (int i = 2; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return argv[i + 1];
    return dflt;
}

static int has_flag(int argc, char **argv, const char *name) {
    for (int i = 2; i < argc; i++)
        if (strcmp(argv[i], name) == 0) return 1;
    return 0;
}

static const char *need(int argc, char **argv, const char *name) {
    const char *v = opt(argc, argv, name, NULL);
    if (!v) { errno = 0; fprintf(stderr, "limit_probe: missing %s\n", name); exit(2); }
    return v;
}

/* Split a comma-separated list in place; returns the number of items. */
static int split(char *s, char **out, int max) {
    int n = 0;
    for (char *tok = strtok(s, ","); tok && n < max; tok = strtok(NULL, ",")) out[n++] = tok;
    return n;
}

static void parse_addr(const char *s, struct sockaddr_in *sa) {
    char host[64];
    const char *colon = strrchr(s, ':');
    errno = 0;
    if (!colon || colon - s >= (long)sizeof host) die("address must be IP:PORT");
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = 0;
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)atoi(colon + 1));
    if (inet_pton(AF_INET, host, &sa->sin_addr) != 1) die("bad IPv4 address");
}

static void parse_mac(const char *s, uint8_t mac[6]) {
    errno = 0;
    if (sscanf(s, "%hhx:%hhx:%hhx:%hhx:%hhx:%hhx", &mac[0], &mac[1], &mac[2], &mac[3], &mac[4], &mac[5]) != 6)
        die("bad MAC address");
}

static void put16(uint8_t *p, uint32_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static void put32(uint8_t *p, uint32_t v) { put16(p, v >> 16); put16(p + 2, v); }
static uint32_t get16(const uint8_t *p) { return (uint32_t)p[0] << 8 | p[1]; }
static uint32_t get32(const uint8_t *p) { return get16(p) << 16 | get16(p + 2); }

static void buffers(int fd) {
    int size = 8 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
}

static int udp_socket(const struct sockaddr_in *bind_to) {
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (fd < 0) die("socket");
    buffers(fd);
    if (bind_to && bind(fd, (const struct sockaddr *)bind_to, sizeof *bind_to) < 0) die("bind");
    return fd;
}

/* Receive coalesced buffers (UDP GRO) on fd. */
static void enable_gro(int fd) {
    int one = 1;
    if (setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof one) < 0) die("setsockopt UDP_GRO (Linux >= 5.0)");
}

/* An AF_PACKET socket bound to one interface that does not see its own transmissions. */
static int raw_socket(const char *ifname) {
    int fd = socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)), one = 1;
    if (fd < 0) die("AF_PACKET socket (needs root)");
    buffers(fd);
    setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one); /* Linux >= 4.20 */
    struct sockaddr_ll ll = {.sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_ALL)};
    ll.sll_ifindex = (int)if_nametoindex(ifname);
    if (!ll.sll_ifindex) die(ifname);
    if (bind(fd, (struct sockaddr *)&ll, sizeof ll) < 0) die("bind AF_PACKET");
    return fd;
}

static uint16_t ip_checksum(const uint8_t *h) {
    uint32_t sum = 0;
    for (int i = 0; i < 20; i += 2) sum += get16(h + i);
    while (sum >> 16) sum = (sum & 0xFFFF) + (sum >> 16);
    return (uint16_t)~sum;
}

/* Ethernet / IPv4 (no options, DF, TTL 64) / UDP (checksum 0) headers for payload_len bytes. */
static void frame_headers(uint8_t *f, const uint8_t dst_mac[6], const uint8_t src_mac[6], struct in_addr src,
                          struct in_addr dst, uint16_t sport, uint16_t dport, int payload_len) {
    memcpy(f, dst_mac, 6);
    memcpy(f + 6, src_mac, 6);
    put16(f + 12, ETH_P_IP);
    uint8_t *ip = f + 14;
    memset(ip, 0, 20);
    ip[0] = 0x45;
    put16(ip + 2, (uint32_t)(28 + payload_len));
    put16(ip + 6, 0x4000);
    ip[8] = 64;
    ip[9] = IPPROTO_UDP;
    memcpy(ip + 12, &src, 4);
    memcpy(ip + 16, &dst, 4);
    put16(ip + 10, ip_checksum(ip));
    uint8_t *udp = ip + 20;
    put16(udp, sport);
    put16(udp + 2, dport);
    put16(udp + 4, (uint32_t)(8 + payload_len));
    put16(udp + 6, 0);
}

/* recvmmsg/sendmmsg buffers; names hold the peer (UDP) or sockaddr_ll (raw). */
struct batch {
    struct mmsghdr msgs[BATCH], out[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_storage names[BATCH];
    uint8_t buf[BATCH][BUF];
};

static int receive(int fd, struct batch *b) {
    for (int i = 0; i < BATCH; i++) {
        b->iov[i] = (struct iovec){b->buf[i], BUF};
        b->msgs[i].msg_hdr = (struct msghdr){.msg_name = &b->names[i], .msg_namelen = sizeof b->names[i],
                                             .msg_iov = &b->iov[i], .msg_iovlen = 1};
    }
    int n = recvmmsg(fd, b->msgs, BATCH, MSG_DONTWAIT, NULL);
    if (n < 0 && errno != EAGAIN && errno != EINTR && errno != ECONNREFUSED) die("recvmmsg");
    if (n > 0) receive_calls++;
    return n < 0 ? 0 : n;
}

/* UDP GRO: recvmmsg of coalesced buffers, each with room for the SOL_UDP/UDP_GRO cmsg. */
union gro_ctl { uint8_t b[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; };
union gso_ctl { uint8_t b[CMSG_SPACE(sizeof(uint16_t))]; struct cmsghdr align; };

struct gro_batch {
    struct mmsghdr msgs[GRO_BATCH];
    struct iovec iov[GRO_BATCH];
    struct sockaddr_storage names[GRO_BATCH];
    union gro_ctl ctl[GRO_BATCH];
    uint8_t buf[GRO_BATCH][GRO_BUF];
};

static int receive_gro(int fd, struct gro_batch *g) {
    for (int i = 0; i < GRO_BATCH; i++) {
        g->iov[i] = (struct iovec){g->buf[i], GRO_BUF};
        g->msgs[i].msg_hdr = (struct msghdr){.msg_name = &g->names[i], .msg_namelen = sizeof g->names[i],
                                             .msg_iov = &g->iov[i], .msg_iovlen = 1,
                                             .msg_control = g->ctl[i].b, .msg_controllen = sizeof g->ctl[i].b};
    }
    int n = recvmmsg(fd, g->msgs, GRO_BATCH, MSG_DONTWAIT, NULL);
    if (n < 0 && errno != EAGAIN && errno != EINTR && errno != ECONNREFUSED) die("recvmmsg");
    if (n > 0) receive_calls++;
    return n < 0 ? 0 : n;
}

/* Segment size of received buffer i: the UDP_GRO cmsg's, else the buffer is one datagram. */
static unsigned gro_segment(struct gro_batch *g, int i) {
    struct msghdr *m = &g->msgs[i].msg_hdr;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c))
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
            int seg;
            memcpy(&seg, CMSG_DATA(c), sizeof seg);
            if (seg > 0) return (unsigned)seg;
        }
    return g->msgs[i].msg_len ? g->msgs[i].msg_len : 1;
}

/* Segments of buffer i (an empty datagram is one). */
static unsigned gro_count(struct gro_batch *g, int i, unsigned seg) {
    unsigned len = g->msgs[i].msg_len;
    return len ? (len + seg - 1) / seg : 1;
}

/* Segments one UDP_SEGMENT send may carry: at most 64, and all of them in one IPv4 datagram. */
static unsigned gso_limit(unsigned seg) {
    unsigned n = UDP_MAX_PAYLOAD / (seg ? seg : 1);
    return n < 1 ? 1 : n > GSO_MAX_SEGS ? GSO_MAX_SEGS : n;
}

/* A message of total bytes from iov, sent as segments of seg bytes (a plain datagram if total <= seg). */
static void gso_message(struct msghdr *h, struct iovec *iov, size_t iovlen, union gso_ctl *ctl, unsigned seg,
                        size_t total, void *name, socklen_t namelen) {
    *h = (struct msghdr){.msg_name = name, .msg_namelen = namelen, .msg_iov = iov, .msg_iovlen = iovlen};
    if (total <= seg) return;
    h->msg_control = ctl->b;
    h->msg_controllen = sizeof ctl->b;
    struct cmsghdr *c = CMSG_FIRSTHDR(h);
    c->cmsg_level = SOL_UDP;
    c->cmsg_type = UDP_SEGMENT;
    c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    uint16_t size = (uint16_t)seg;
    memcpy(CMSG_DATA(c), &size, sizeof size);
}

static int is_outgoing(const struct batch *b, int i, int raw) {
    return raw && ((const struct sockaddr_ll *)&b->names[i])->sll_pkttype == PACKET_OUTGOING;
}

/* sendmmsg all n messages (blocking when the socket buffer is full); returns how many went, each
 * message counted weights[i] times (datagrams of a UDP_SEGMENT message) or once with weights NULL. */
static uint64_t send_all(int fd, struct mmsghdr *msgs, int n, const unsigned *weights) {
    int done = 0;
    uint64_t went = 0;
    while (done < n) {
        int r = sendmmsg(fd, msgs + done, (unsigned)(n - done), 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno == ECONNREFUSED) r = 1; /* an earlier ICMP error; counted as before */
        else if (r < 0) die(gso_sends ? "sendmmsg with UDP_SEGMENT (needs tx checksumming on the device, "
                                        "header + segment <= MTU, <= 64 segments)" : "sendmmsg");
        else send_calls++;
        for (int i = done; i < done + r; i++) went += weights ? weights[i] : 1;
        done += r;
    }
    return went;
}

static double per(uint64_t datagrams, uint64_t calls) { return calls ? (double)datagrams / (double)calls : 0.0; }

static void install_signals(void) {
    struct sigaction sa = {.sa_handler = on_signal}; /* no SA_RESTART: poll returns EINTR */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

static int reflect(int fd, int raw, int netagg, const char *mode) {
    struct batch *b = calloc(1, sizeof *b);
    uint64_t received = 0, sent = 0;
    struct pollfd p = {fd, POLLIN, 0};
    double t0 = now();
    while (!stop_flag) {
        if (poll(&p, 1, 200) <= 0) continue;
        int n = receive(fd, b), m = 0;
        for (int i = 0; i < n; i++) {
            uint8_t *f = b->buf[i], tmp[6];
            unsigned len = b->msgs[i].msg_len, off = raw ? L2L4 : 0;
            if (is_outgoing(b, i, raw) || (raw && len < 14)) continue;
            if (raw) { memcpy(tmp, f, 6); memcpy(f, f + 6, 6); memcpy(f + 6, tmp, 6); }
            if (netagg && len > off + 1) f[off + 1] |= FLAG_RESULT;
            b->iov[i].iov_len = len;
            b->out[m] = b->msgs[i];
            if (raw) b->out[m].msg_hdr.msg_name = NULL, b->out[m].msg_hdr.msg_namelen = 0;
            m++;
        }
        received += (uint64_t)m;
        sent += send_all(fd, b->out, m, NULL);
    }
    printf("{\"mode\": \"%s\", \"netagg\": %s, \"gro\": false, \"gso\": false, \"received\": %llu, "
           "\"sent\": %llu, \"receive_calls\": %llu, \"send_calls\": %llu, \"datagrams_per_receive\": %.2f, "
           "\"datagrams_per_send\": %.2f, \"seconds\": %.3f, \"cpu_seconds\": %.3f}\n", mode,
           netagg ? "true" : "false", (unsigned long long)received, (unsigned long long)sent,
           (unsigned long long)receive_calls, (unsigned long long)send_calls, per(received, receive_calls),
           per(sent, send_calls), now() - t0, cpu_seconds());
    return 0;
}

/* udp-reflect --gro: each coalesced buffer goes back as UDP_SEGMENT sends of its own segment size. */
static int reflect_gro(int fd, int netagg) {
    enum { OUT = 4 * GRO_BATCH };
    struct gro_batch *g = calloc(1, sizeof *g);
    struct mmsghdr out[OUT];
    struct iovec iov[OUT];
    union gso_ctl ctl[OUT];
    unsigned weights[OUT];
    uint64_t received = 0, sent = 0, buffers_in = 0, messages_out = 0;
    struct pollfd p = {fd, POLLIN, 0};
    double t0 = now();
    enable_gro(fd);
    gso_sends = 1;
    while (!stop_flag) {
        if (poll(&p, 1, 200) <= 0) continue;
        int n = receive_gro(fd, g), m = 0;
        for (int i = 0; i < n; i++) {
            unsigned len = g->msgs[i].msg_len, seg = gro_segment(g, i), segs = gro_count(g, i, seg);
            unsigned limit = gso_limit(seg);
            uint8_t *f = g->buf[i];
            received += segs;
            if (netagg)
                for (unsigned off = 0; off < len; off += seg)
                    if (len - off > 1) f[off + 1] |= FLAG_RESULT;
            for (unsigned first = 0; first < segs; first += limit) {
                unsigned k = segs - first < limit ? segs - first : limit;
                size_t start = (size_t)first * seg, bytes = len - start < (size_t)k * seg ? len - start : (size_t)k * seg;
                if (m == OUT) { sent += send_all(fd, out, m, weights); m = 0; }
                iov[m] = (struct iovec){f + start, bytes};
                gso_message(&out[m].msg_hdr, &iov[m], 1, &ctl[m], seg, bytes, &g->names[i],
                            g->msgs[i].msg_hdr.msg_namelen);
                weights[m++] = k;
                messages_out++;
            }
        }
        buffers_in += (uint64_t)n;
        if (m) sent += send_all(fd, out, m, weights);
    }
    printf("{\"mode\": \"udp-reflect\", \"netagg\": %s, \"gro\": true, \"gso\": true, \"received\": %llu, "
           "\"sent\": %llu, \"receive_calls\": %llu, \"send_calls\": %llu, \"datagrams_per_receive\": %.2f, "
           "\"datagrams_per_send\": %.2f, \"buffers_received\": %llu, \"gso_sends\": %llu, "
           "\"datagrams_per_buffer\": %.2f, \"seconds\": %.3f, \"cpu_seconds\": %.3f}\n",
           netagg ? "true" : "false", (unsigned long long)received, (unsigned long long)sent,
           (unsigned long long)receive_calls, (unsigned long long)send_calls, per(received, receive_calls),
           per(sent, send_calls), (unsigned long long)buffers_in, (unsigned long long)messages_out,
           per(received, buffers_in), now() - t0, cpu_seconds());
    return 0;
}

/* The client's payload check: a sequence number at payload byte 4 and a hash of it in the last 4 bytes of
 * payloads of >= 16 bytes; the rest is FILL (byte 1 may carry the RESULT flag of a --netagg reflector). */
static uint32_t mix(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

static void stamp(uint8_t *f, int off, int size, uint32_t seq) {
    if (size - off < 16) return;
    put32(f + off + 4, seq);
    put32(f + size - 4, mix(seq));
}

static int bad_payload(const uint8_t *f, int off, unsigned len, int size, uint32_t next_seq) {
    if (len != (unsigned)size) return 1;
    if (size - off < 16) return 0;
    const uint8_t *p = f + off;
    uint32_t seq = get32(p + 4);
    return p[0] != FILL || (p[1] & ~FLAG_RESULT) != FILL || p[2] != FILL || p[3] != FILL
           || get32(p + 8) != 0x5a5a5a5au || seq >= next_seq || get32(f + size - 4) != mix(seq);
}

struct client_counts { uint64_t received, round_trips, errors; int fill; };

/* One datagram (UDP) or frame (raw) that came back to the client. */
static void client_reply(struct client_counts *c, int raw, const uint8_t *tmpl, const uint8_t *f, unsigned len,
                         int size, uint32_t next_seq) {
    if (raw && (len != (unsigned)size || memcmp(f + 6, tmpl, 6) != 0)) return; /* not reflected: src MAC = our dst */
    c->received++;
    c->fill++;
    if (bad_payload(f, raw ? L2L4 : 0, len, size, next_seq)) c->errors++;
    else c->round_trips++;
}

/* Keep `window` datagrams in flight: one new send per reply; all lost after 100 ms of silence. Per datagram:
 * sendmmsg of up to 64 single-datagram messages; --gso: UDP_SEGMENT messages of up to 64 segments. */
static int client(int fd, int raw, int gso, const uint8_t *tmpl, int size, int window, double seconds,
                  const char *mode) {
    int off = raw ? L2L4 : 0, segs = gso ? (int)gso_limit((unsigned)size) : 1;
    struct batch *b = gso ? NULL : calloc(1, sizeof *b);
    struct gro_batch *g = gso ? calloc(1, sizeof *g) : NULL;
    uint8_t *tx = malloc((size_t)BATCH * (size_t)segs * (size_t)size);
    for (int i = 0; i < BATCH * segs; i++) memcpy(tx + (size_t)i * (size_t)size, tmpl, (size_t)size);
    struct mmsghdr out[BATCH];
    struct iovec iov[BATCH];
    union gso_ctl ctl[BATCH];
    struct client_counts c = {0, 0, 0, window};
    uint64_t sent = 0, timeouts = 0;
    uint32_t seq = 0;
    struct pollfd p = {fd, POLLIN, 0};
    if (gso) enable_gro(fd);
    gso_sends = gso;
    double c0 = cpu_seconds(), t0 = now(), deadline = t0 + seconds;
    while (now() < deadline && !stop_flag) {
        while (c.fill > 0) {
            int m = 0, used = 0;
            while (c.fill > 0 && m < BATCH) {
                int k = c.fill < segs ? c.fill : segs;
                uint8_t *first = tx + (size_t)used * (size_t)size;
                for (int j = 0; j < k; j++) stamp(first + (size_t)j * (size_t)size, off, size, seq++);
                iov[m] = (struct iovec){first, (size_t)k * (size_t)size};
                gso_message(&out[m].msg_hdr, &iov[m], 1, &ctl[m], (unsigned)size, iov[m].iov_len, NULL, 0);
                used += k;
                c.fill -= k;
                m++;
            }
            send_all(fd, out, m, NULL);
            sent += (uint64_t)used;
        }
        if (poll(&p, 1, 100) == 0) { timeouts++; c.fill = window; continue; }
        if (gso) {
            int n = receive_gro(fd, g);
            for (int i = 0; i < n; i++) {
                unsigned len = g->msgs[i].msg_len, seg = gro_segment(g, i);
                for (unsigned o = 0; o < len; o += seg)
                    client_reply(&c, raw, tmpl, g->buf[i] + o, len - o < seg ? len - o : seg, size, seq);
            }
        } else {
            int n = receive(fd, b);
            for (int i = 0; i < n; i++)
                if (!is_outgoing(b, i, raw)) client_reply(&c, raw, tmpl, b->buf[i], b->msgs[i].msg_len, size, seq);
        }
    }
    double el = now() - t0;
    printf("{\"mode\": \"%s\", \"gso\": %s, \"size\": %d, \"window\": %d, \"seconds\": %.3f, \"round_trips\": %llu, "
           "\"round_trips_per_s\": %.1f, \"timeouts\": %llu, \"payload_errors\": %llu, \"sent\": %llu, "
           "\"received\": %llu, \"send_calls\": %llu, \"receive_calls\": %llu, \"datagrams_per_send\": %.2f, "
           "\"datagrams_per_receive\": %.2f, \"cpu_seconds\": %.3f}\n", mode, gso ? "true" : "false", size, window,
           el, (unsigned long long)c.round_trips, (double)c.round_trips / el, (unsigned long long)timeouts,
           (unsigned long long)c.errors, (unsigned long long)sent, (unsigned long long)c.received,
           (unsigned long long)send_calls, (unsigned long long)receive_calls, per(sent, send_calls),
           per(c.received, receive_calls), cpu_seconds() - c0);
    return 0;
}

/* netagg-drive: one (worker, slot) cell of the SwitchML-style load. */
struct cell { uint32_t round; uint32_t uses; int waiting, resent; double sent_at; };

struct worker {
    int fd;
    uint8_t *pkts;        /* slots * pkt_len bytes: the slot's current contribution */
    struct cell *cells;
    struct mmsghdr q[BATCH];
    struct iovec qiov[BATCH];
    union gso_ctl qctl;   /* --gso: the queue goes as one UDP_SEGMENT send of qiov */
    int qblock;           /* --gso: the steering block (slot >> 6) of the queued datagrams */
    int queued;
};

struct drive {
    int workers, slots, raw, gso, hoff, pkt_len, job;
    uint32_t rounds;      /* 0: run for seconds */
    struct sockaddr_in target;
    struct worker w[MAX_WORKERS];
    uint64_t sent, retransmissions, received, accepted;
    uint64_t datagrams_out, datagrams_in; /* every datagram sent (resends too) / received */
    double srtt;          /* smoothed round trip of contributions sent once (Karn) */
};

static void flush(struct drive *d, struct worker *w) {
    if (!w->queued) return;
    if (d->gso) {
        struct mmsghdr m;
        gso_message(&m.msg_hdr, w->qiov, (size_t)w->queued, &w->qctl, (unsigned)d->pkt_len,
                    (size_t)w->queued * (size_t)d->pkt_len, &d->target, sizeof d->target);
        send_all(w->fd, &m, 1, NULL);
    } else {
        send_all(w->fd, w->q, w->queued, NULL);
    }
    d->datagrams_out += (uint64_t)w->queued;
    w->queued = 0;
}

static void enqueue(struct drive *d, struct worker *w, int slot, double t) {
    if (w->queued == BATCH) flush(d, w); /* BATCH = 64: also the segments of one UDP_SEGMENT send */
    /* A segmented send carries one steering block (64 slots: docs/protocol.md, "Steering"). */
    if (d->gso && w->queued && (slot >> 6) != w->qblock) flush(d, w);
    w->qblock = slot >> 6;
    w->qiov[w->queued] = (struct iovec){w->pkts + (size_t)slot * (size_t)d->pkt_len, (size_t)d->pkt_len};
    w->q[w->queued].msg_hdr = (struct msghdr){.msg_iov = &w->qiov[w->queued], .msg_iovlen = 1,
                                              .msg_name = d->raw ? NULL : &d->target,
                                              .msg_namelen = d->raw ? 0 : sizeof d->target};
    w->queued++;
    w->cells[slot].waiting = 1;
    w->cells[slot].sent_at = t;
}

/* Write the slot's next contribution (round + 1, other pool, next seq) and queue it. */
static void next_contribution(struct drive *d, int rank, int slot, double t) {
    struct worker *w = &d->w[rank];
    struct cell *c = &w->cells[slot];
    uint8_t *h = w->pkts + (size_t)slot * (size_t)d->pkt_len + d->hoff;
    c->round++;
    c->resent = 0;
    h[0] = NETAGG_VERSION; h[1] = 0;
    put16(h + 2, (uint32_t)d->job);
    put16(h + 4, (uint32_t)slot);
    h[6] = (uint8_t)((c->round - 1) & 1);
    h[7] = (uint8_t)rank;
    h[8] = h[9] = 0;
    put16(h + 10, c->round & 0xFFFF);
    put32(h + 12, (c->round - 1) * (uint32_t)d->slots + (uint32_t)slot);
    put32(h + 16, 0); /* members: every worker of the job */
    put32(h + 20, 0); /* exchange: one collective throughout */
    d->sent++;
    enqueue(d, w, slot, t);
}

/* A result for this worker's slot in its current round? Then start the slot's next round. */
static void on_packet(struct drive *d, int rank, const uint8_t *f, unsigned len, double t) {
    if (len < (unsigned)(d->hoff + NETAGG_BYTES)) return;
    if (d->raw && (get16(f + 12) != ETH_P_IP || f[14] != 0x45 || f[23] != IPPROTO_UDP)) return;
    const uint8_t *h = f + d->hoff;
    if (h[0] != NETAGG_VERSION || !(h[1] & FLAG_RESULT) || get16(h + 2) != (uint32_t)d->job) return;
    d->received++;
    uint32_t slot = get16(h + 4);
    if (slot >= (uint32_t)d->slots) return;
    struct cell *c = &d->w[rank].cells[slot];
    if (!c->waiting || get16(h + 10) != (c->round & 0xFFFF)) return; /* stale or duplicate */
    c->waiting = 0;
    if (!c->resent) d->srtt = d->srtt > 0 ? d->srtt + (t - c->sent_at - d->srtt) / 8 : t - c->sent_at;
    c->uses++;
    d->accepted++;
    if (!d->rounds || c->uses < d->rounds) next_contribution(d, rank, (int)slot, t);
}

static int drive(int argc, char **argv) {
    static struct drive d;
    static char lists[4][4096];
    char *ifnames[MAX_WORKERS], *ips[MAX_WORKERS], *macs[MAX_WORKERS], *ports[MAX_WORKERS];
    d.workers = atoi(need(argc, argv, "--workers"));
    d.slots = atoi(opt(argc, argv, "--slots", "32"));
    d.job = atoi(opt(argc, argv, "--job", "1"));
    d.rounds = (uint32_t)atoi(opt(argc, argv, "--rounds", "0"));
    double seconds = atof(opt(argc, argv, "--seconds", d.rounds ? "300" : "2"));
    double rto_min = atof(opt(argc, argv, "--rto-ms", "20")) / 1e3, rto = rto_min;
    d.raw = has_flag(argc, argv, "--raw");
    d.gso = has_flag(argc, argv, "--gso");
    errno = 0;
    if (d.raw && d.gso) die("--gso is for --udp");
    if (d.workers < 1 || d.workers > MAX_WORKERS || d.slots < 1 || d.slots > 65536) die("bad --workers/--slots");
    d.hoff = d.raw ? L2L4 : 0;
    d.pkt_len = d.hoff + NETAGG_BYTES;
    if (d.raw) {
        int base = atoi(opt(argc, argv, "--udp-src-base", "40000"));
        uint8_t dst_mac[6], src_mac[6];
        struct in_addr src, dst;
        parse_mac(need(argc, argv, "--dst-mac"), dst_mac);
        if (inet_pton(AF_INET, need(argc, argv, "--dst-ip"), &dst) != 1) die("bad --dst-ip");
        snprintf(lists[0], sizeof lists[0], "%s", need(argc, argv, "--ifnames"));
        snprintf(lists[1], sizeof lists[1], "%s", need(argc, argv, "--src-ips"));
        snprintf(lists[2], sizeof lists[2], "%s", need(argc, argv, "--src-macs"));
        if (split(lists[0], ifnames, MAX_WORKERS) != d.workers || split(lists[1], ips, MAX_WORKERS) != d.workers
            || split(lists[2], macs, MAX_WORKERS) != d.workers) die("need one interface, IP and MAC per worker");
        for (int r = 0; r < d.workers; r++) {
            d.w[r].fd = raw_socket(ifnames[r]);
            parse_mac(macs[r], src_mac);
            if (inet_pton(AF_INET, ips[r], &src) != 1) die("bad --src-ips");
            d.w[r].pkts = calloc((size_t)d.slots, (size_t)d.pkt_len);
            for (int s = 0; s < d.slots; s++)
                frame_headers(d.w[r].pkts + (size_t)s * (size_t)d.pkt_len, dst_mac, src_mac, src, dst,
                              (uint16_t)(base + r), NETAGG_PORT, NETAGG_BYTES);
        }
    } else {
        if (!has_flag(argc, argv, "--udp")) die("netagg-drive needs --udp or --raw");
        parse_addr(need(argc, argv, "--target"), &d.target);
        snprintf(lists[3], sizeof lists[3], "%s", need(argc, argv, "--bind-ports"));
        if (split(lists[3], ports, MAX_WORKERS) != d.workers) die("need one --bind-ports entry per worker");
        for (int r = 0; r < d.workers; r++) {
            struct sockaddr_in local = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(ports[r])),
                                        .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
            d.w[r].fd = udp_socket(&local);
            if (d.gso) enable_gro(d.w[r].fd);
            d.w[r].pkts = calloc((size_t)d.slots, (size_t)d.pkt_len);
        }
    }
    struct pollfd pfds[MAX_WORKERS];
    for (int r = 0; r < d.workers; r++) {
        d.w[r].cells = calloc((size_t)d.slots, sizeof(struct cell));
        for (int s = 0; s < d.slots; s++)
            for (int k = 0; k < K; k++)
                put32(d.w[r].pkts + (size_t)s * (size_t)d.pkt_len + d.hoff + NETAGG_HDR + 4 * k, (uint32_t)(r + 1));
        pfds[r] = (struct pollfd){d.w[r].fd, POLLIN, 0};
    }
    struct batch *b = d.gso ? NULL : calloc(1, sizeof *b);
    struct gro_batch *g = d.gso ? calloc(1, sizeof *g) : NULL;
    gso_sends = d.gso;
    double c0 = cpu_seconds(), t0 = now(), deadline = t0 + seconds, t = t0, last_scan = t0;
    for (int r = 0; r < d.workers; r++) {
        for (int s = 0; s < d.slots; s++) next_contribution(&d, r, s, t0);
        flush(&d, &d.w[r]);
    }
    uint64_t target_uses = (uint64_t)d.rounds * (uint64_t)d.slots * (uint64_t)d.workers;
    while (!stop_flag && t < deadline && (!d.rounds || d.accepted < target_uses)) {
        poll(pfds, (nfds_t)d.workers, 1);
        t = now();
        for (int r = 0; r < d.workers; r++) {
            if (!(pfds[r].revents & POLLIN)) continue;
            int n;
            if (d.gso) {
                do { /* coalesced results: split by the segment size */
                    n = receive_gro(d.w[r].fd, g);
                    for (int i = 0; i < n; i++) {
                        unsigned len = g->msgs[i].msg_len, seg = gro_segment(g, i);
                        d.datagrams_in += gro_count(g, i, seg);
                        for (unsigned o = 0; o < len; o += seg)
                            on_packet(&d, r, g->buf[i] + o, len - o < seg ? len - o : seg, t);
                    }
                } while (n == GRO_BATCH);
                continue;
            }
            do {
                n = receive(d.w[r].fd, b);
                for (int i = 0; i < n; i++)
                    if (!is_outgoing(b, i, d.raw)) {
                        d.datagrams_in++;
                        on_packet(&d, r, b->buf[i], b->msgs[i].msg_len, t);
                    }
            } while (n == BATCH);
        }
        if (t - last_scan >= rto_min / 4) { /* resend the same bytes after rto without a result */
            last_scan = t;
            rto = 4 * d.srtt > rto_min ? 4 * d.srtt : rto_min; /* a slow switch is not a lossy one */
            for (int r = 0; r < d.workers; r++)
                for (int s = 0; s < d.slots; s++)
                    if (d.w[r].cells[s].waiting && t - d.w[r].cells[s].sent_at >= rto) {
                        d.retransmissions++;
                        d.w[r].cells[s].resent = 1;
                        enqueue(&d, &d.w[r], s, t);
                    }
        }
        for (int r = 0; r < d.workers; r++) flush(&d, &d.w[r]);
    }
    double el = now() - t0, cpu = cpu_seconds() - c0;
    /* contributions/s = accepted results / s: each accepted result acknowledges one contribution of its
     * worker; with a switch that multicasts every result this is rounds_completed x W / s (up to the rounds
     * in flight at the end), and it stays right against a reflector, where workers are independent. */
    uint64_t rounds_done = 0; /* (slot, round) pairs whose result reached every worker */
    for (int s = 0; s < d.slots; s++) {
        uint32_t m = UINT32_MAX;
        for (int r = 0; r < d.workers; r++) m = d.w[r].cells[s].uses < m ? d.w[r].cells[s].uses : m;
        rounds_done += m;
    }
    printf("{\"mode\": \"netagg-drive\", \"transport\": \"%s\", \"gso\": %s, \"workers\": %d, \"slots\": %d, "
           "\"seconds\": %.3f, "
           "\"contributions_sent\": %llu, \"retransmissions\": %llu, \"results_received\": %llu, "
           "\"results_accepted\": %llu, \"rounds_completed\": %llu, \"contributions_per_s\": %.1f, "
           "\"srtt_ms\": %.3f, \"rto_ms\": %.3f, \"send_calls\": %llu, \"receive_calls\": %llu, "
           "\"datagrams_per_send\": %.2f, \"datagrams_per_receive\": %.2f, "
           "\"cpu_seconds\": %.3f, \"cpu_share\": %.3f}\n",
           d.raw ? "raw" : "udp", d.gso ? "true" : "false", d.workers, d.slots, el,
           (unsigned long long)d.sent, (unsigned long long)d.retransmissions, (unsigned long long)d.received,
           (unsigned long long)d.accepted, (unsigned long long)rounds_done, (double)d.accepted / el, d.srtt * 1e3,
           rto * 1e3, (unsigned long long)send_calls, (unsigned long long)receive_calls,
           per(d.datagrams_out, send_calls), per(d.datagrams_in, receive_calls), cpu, cpu / el);
    return 0;
}

int main(int argc, char **argv) {
    static const uint8_t switch_mac[6] = {2, 0, 0, 0, 0, 0xfe}, host_mac[6] = {2, 0, 0, 0x88, 0, 1};
    static uint8_t tmpl[BUF];
    const char *cmd = argc > 1 ? argv[1] : "";
    install_signals();
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (strcmp(cmd, "udp-reflect") == 0 || strcmp(cmd, "raw-reflect") == 0) {
        int raw = cmd[0] == 'r', fd;
        if (raw) {
            fd = raw_socket(need(argc, argv, "--ifname"));
            fprintf(stderr, "listening %s\n", need(argc, argv, "--ifname"));
        } else {
            struct sockaddr_in sa;
            socklen_t len = sizeof sa;
            parse_addr(need(argc, argv, "--bind"), &sa);
            fd = udp_socket(&sa);
            getsockname(fd, (struct sockaddr *)&sa, &len);
            char ip[INET_ADDRSTRLEN];
            fprintf(stderr, "listening %s:%d\n", inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof ip), ntohs(sa.sin_port));
        }
        if (has_flag(argc, argv, "--gro")) {
            errno = 0;
            if (raw) die("--gro is for udp-reflect");
            return reflect_gro(fd, has_flag(argc, argv, "--netagg"));
        }
        return reflect(fd, raw, has_flag(argc, argv, "--netagg"), cmd);
    }
    if (strcmp(cmd, "udp-client") == 0 || strcmp(cmd, "raw-client") == 0) {
        int raw = cmd[0] == 'r', gso = has_flag(argc, argv, "--gso"), fd;
        int size = atoi(opt(argc, argv, "--size", raw ? "322" : "280")), window = atoi(opt(argc, argv, "--window", "64"));
        double seconds = atof(opt(argc, argv, "--seconds", "2"));
        errno = 0;
        if (size < (raw ? L2L4 : 1) || size > BUF || window < 1) die("bad --size or --window");
        if (raw && gso) die("--gso is for udp-client");
        memset(tmpl, FILL, sizeof tmpl);
        if (raw) {
            struct in_addr src = {htonl(0x0a580001)}, dst = {htonl(0x0a5800fe)};
            fd = raw_socket(need(argc, argv, "--ifname"));
            frame_headers(tmpl, switch_mac, host_mac, src, dst, 40000, NETAGG_PORT, size - L2L4);
        } else {
            struct sockaddr_in target;
            parse_addr(need(argc, argv, "--target"), &target);
            fd = udp_socket(NULL);
            if (connect(fd, (struct sockaddr *)&target, sizeof target) < 0) die("connect");
        }
        return client(fd, raw, gso, tmpl, size, window, seconds, cmd);
    }
    if (strcmp(cmd, "netagg-drive") == 0) return drive(argc, argv);
    fprintf(stderr, "usage: limit_probe udp-reflect|udp-client|raw-reflect|raw-client|netagg-drive [options]\n"
                    "(see the comment at the top of limit_probe.c)\n");
    return 2;
}

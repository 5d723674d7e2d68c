/* Preloaded (LD_PRELOAD) into `keras-rec-emb ps` by
 * keras_rec_emb/distribute/ps.py: TensorFlow's gRPC server binds
 * "0.0.0.0:<port>" whatever host its task address names
 * (GrpcServer::Init), and gRPC turns that into a dual-stack [::] socket
 * listening on every interface. This bind() gives such a wildcard bind the
 * address the cluster names instead.
 *
 * KRE_BIND_MAP="PORT=IP,...,*=IP": a wildcard bind on PORT binds IP (IP
 * "*": left a wildcard, the address asked for every interface); the port
 * "*" stands for any other port (the PS process's own helper servers,
 * which need only loopback). Other binds are passed on unchanged. A v4 IP on an
 * IPv6 socket becomes its v4-mapped address (::ffff:a.b.c.d), which a
 * dual-stack socket serves as that v4 address alone. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr*, socklen_t);

/* The IP KRE_BIND_MAP gives `port` (copied into out), or 0. */
static int mapped_ip(int port, char* out, size_t size) {
  const char* map = getenv("KRE_BIND_MAP");
  const char* fallback = NULL;
  size_t fallback_len = 0;
  while (map && *map) {
    const char* end = strchr(map, ',');
    size_t len = end ? (size_t)(end - map) : strlen(map);
    const char* eq = memchr(map, '=', len);
    if (eq) {
      const char* ip = eq + 1;
      size_t ip_len = len - (size_t)(ip - map);
      if (eq - map == 1 && map[0] == '*') {
        fallback = ip;
        fallback_len = ip_len;
      } else if (atoi(map) == port && ip_len < size) {
        memcpy(out, ip, ip_len);
        out[ip_len] = '\0';
        return 1;
      }
    }
    map = end ? end + 1 : NULL;
  }
  if (fallback && fallback_len < size) {
    memcpy(out, fallback, fallback_len);
    out[fallback_len] = '\0';
    return 1;
  }
  return 0;
}

int bind(int fd, const struct sockaddr* addr, socklen_t len) {
  static bind_fn real = NULL;
  if (!real) real = (bind_fn)dlsym(RTLD_NEXT, "bind");
  if (!real) {
    errno = ENOSYS;
    return -1;
  }
  char ip[INET6_ADDRSTRLEN + 1];
  if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
    struct sockaddr_in a;
    memcpy(&a, addr, sizeof(a));
    if (a.sin_addr.s_addr != htonl(INADDR_ANY) || a.sin_port == 0 ||
        !mapped_ip(ntohs(a.sin_port), ip, sizeof(ip)) || strcmp(ip, "*") == 0)
      return real(fd, addr, len);
    if (inet_pton(AF_INET, ip, &a.sin_addr) != 1) {
      errno = EAFNOSUPPORT; /* an IPv6 address cannot go on an IPv4 socket */
      return -1;
    }
    return real(fd, (const struct sockaddr*)&a, sizeof(a));
  }
  if (addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 a;
    memcpy(&a, addr, sizeof(a));
    if (!IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) || a.sin6_port == 0 ||
        !mapped_ip(ntohs(a.sin6_port), ip, sizeof(ip)) || strcmp(ip, "*") == 0)
      return real(fd, addr, len);
    struct in_addr v4;
    if (inet_pton(AF_INET, ip, &v4) == 1) {
      memset(&a.sin6_addr, 0, sizeof(a.sin6_addr));
      a.sin6_addr.s6_addr[10] = 0xff;
      a.sin6_addr.s6_addr[11] = 0xff;
      memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
    } else if (inet_pton(AF_INET6, ip, &a.sin6_addr) != 1) {
      errno = EADDRNOTAVAIL;
      return -1;
    }
    return real(fd, (const struct sockaddr*)&a, sizeof(a));
  }
  return real(fd, addr, len);
}

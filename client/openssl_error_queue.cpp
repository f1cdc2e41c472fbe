// A workaround for Debian's CAF 0.17.6 OpenSSL module: its sessions call SSL_read, SSL_write
// and the handshake functions without clearing OpenSSL's per-thread error queue first, so an
// error left by one connection (a peer that closed, a refused handshake) is read as the failure
// of the next connection served on the same thread -- which CAF then closes. Measured: one
// refused plain-TCP connection to a TLS head cut every node's TLS connection to it
// (tests/deploy/tls_e2e.sh). These definitions interpose OpenSSL's (this file is linked into
// the `baton` executable, whose link exports them, and into libbaton_client.so): each clears the
// queue, as OpenSSL's documentation asks before these calls, then calls the real function.

#include <dlfcn.h>

extern "C" {

struct ssl_st;
void ERR_clear_error(void);

#define BATON_SSL_WRAP(name, params, args)                                            \
  int name params {                                                                   \
    using fn = int(*) params;                                                         \
    static fn real = reinterpret_cast<fn>(dlsym(RTLD_NEXT, #name));                   \
    ERR_clear_error();                                                                \
    return real args;                                                                 \
  }

BATON_SSL_WRAP(SSL_read, (ssl_st * s, void* buf, int num), (s, buf, num))
BATON_SSL_WRAP(SSL_write, (ssl_st * s, const void* buf, int num), (s, buf, num))
BATON_SSL_WRAP(SSL_accept, (ssl_st * s), (s))
BATON_SSL_WRAP(SSL_connect, (ssl_st * s), (s))
BATON_SSL_WRAP(SSL_do_handshake, (ssl_st * s), (s))
BATON_SSL_WRAP(SSL_shutdown, (ssl_st * s), (s))

#undef BATON_SSL_WRAP
}

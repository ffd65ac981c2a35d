/* logstore/_framing.h: one logstore record's frame, shared by the C twins that write records
 * (logstore/_framing.c's frame_records, realtime/storage/_codecs.c's encode_run and
 * write_run), so the layout lives in one place:
 *
 *     u32 body_length | u32 crc32 | u16 magic 0x514D | u8 version 1 | u8 attributes 0 | body
 *
 * all big-endian, the CRC being zlib's CRC-32 over bytes 0..3 and 8..end (logstore/record.py
 * has the table and the pure-Python twin). Include after <Python.h> and <zlib.h>.
 *
 * And the durable write of a group commit, shared the same way (_framing.c's write_sync,
 * _codecs.c's write_run), so both report a fault alike: logstore_write_sync_released writes
 * all of the data at its offset (looping over short writes and EINTR), fdatasyncs, and after a
 * good fsync writes the then-data (another file's bytes); the caller releases the GIL around
 * it. logstore.fileio.write_sync_python is its Python twin.
 */

#ifndef QMQ_LOGSTORE_FRAMING_H
#define QMQ_LOGSTORE_FRAMING_H

#include <errno.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#define LOGSTORE_HEADER_SIZE_BYTES 12

static void logstore_store_be32(unsigned char *p, uint32_t value)
{
    p[0] = (unsigned char)(value >> 24);
    p[1] = (unsigned char)(value >> 16);
    p[2] = (unsigned char)(value >> 8);
    p[3] = (unsigned char)value;
}

/* Frame the body of ``size`` bytes already at ``record + LOGSTORE_HEADER_SIZE_BYTES``: write the
 * header in front of it (the CRC covers the length, the rest of the header and the body). */
static void logstore_frame_in_place(unsigned char *record, size_t size)
{
    logstore_store_be32(record, (uint32_t)size);
    record[8] = 0x51; /* magic 0x514D, "QM" */
    record[9] = 0x4D;
    record[10] = 1; /* version */
    record[11] = 0; /* attributes */
    uint32_t crc = (uint32_t)crc32_z(0, record, 4);
    crc = (uint32_t)crc32_z(crc, record + 8, 4 + size);
    logstore_store_be32(record + 4, crc);
}

static inline long long logstore_monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* pwrite all of size bytes at offset, looping over short writes (and EINTR): 0, or the errno
 * of the pwrite that failed after *written bytes. Called with the GIL released. */
static inline int logstore_pwrite_all(int fd, const char *bytes, Py_ssize_t size,
                                      long long offset, Py_ssize_t *written)
{
    while (*written < size) {
        ssize_t done = pwrite(fd, bytes + *written, (size_t)(size - *written),
                              (off_t)(offset + *written));
        if (done < 0) {
            if (errno == EINTR) {
                continue;
            }
            return errno;
        }
        *written += done;
    }
    return 0;
}

/* One durable write: its inputs (then_data NULL for no then-write) and what it did. */
struct logstore_sync_write {
    int fd;
    const char *data;
    Py_ssize_t size;
    long long offset;
    int then_fd;
    const char *then_data;
    Py_ssize_t then_size;
    long long then_offset;
    Py_ssize_t written;      /* bytes of data written (all of them unless write_errno) */
    int write_errno;         /* the failed pwrite's errno; then no fsync */
    int fsync_errno;         /* the failed fsync's errno; then no then-write */
    long long fsync_ns;      /* the fsync's own CLOCK_MONOTONIC time (no GIL wait in it) */
    long long synced_at_ns;  /* CLOCK_MONOTONIC when the fsync returned */
    Py_ssize_t then_written; /* bytes of then_data written */
    int then_errno;          /* the failed then-pwrite's errno */
};

/* Do the write w describes; called with the GIL released (nothing here touches a Python
 * object: the caller keeps the buffers alive). */
static inline void logstore_write_sync_released(struct logstore_sync_write *w)
{
    w->written = w->then_written = 0;
    w->write_errno = w->fsync_errno = w->then_errno = 0;
    w->fsync_ns = w->synced_at_ns = 0;
    w->write_errno = logstore_pwrite_all(w->fd, w->data, w->size, w->offset, &w->written);
    if (w->write_errno != 0) {
        return;
    }
    long long started_ns = logstore_monotonic_ns();
    /* fdatasync, not fsync: the data and the metadata needed to read it back (a new size,
     * extents written into space allocated ahead), not the times (logstore/fileio.py's
     * docstring). EINTR is retried, as os.fdatasync does (PEP 475): a signal delivered to
     * this thread while an NFS or FUSE fsync waits must not make the log sticky-failed. */
    while (fdatasync(w->fd) != 0) {
        if (errno != EINTR) {
            w->fsync_errno = errno;
            break;
        }
    }
    w->synced_at_ns = logstore_monotonic_ns();
    w->fsync_ns = w->synced_at_ns - started_ns;
    if (w->fsync_errno == 0 && w->then_data != NULL) {
        w->then_errno = logstore_pwrite_all(w->then_fd, w->then_data, w->then_size,
                                            w->then_offset, &w->then_written);
    }
}

#endif

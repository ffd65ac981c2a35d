/* logstore/_framing.h: one logstore record's frame, shared by the C twins that write records
 * (logstore/_framing.c's frame_records, realtime/storage/_codecs.c's encode_run), so the
 * layout lives in one place:
 *
 *     u32 body_length | u32 crc32 | u16 magic 0x514D | u8 version 1 | u8 attributes 0 | body
 *
 * all big-endian, the CRC being zlib's CRC-32 over bytes 0..3 and 8..end (logstore/record.py
 * has the table and the pure-Python twin). Include after <Python.h> and <zlib.h>.
 */

#ifndef QMQ_LOGSTORE_FRAMING_H
#define QMQ_LOGSTORE_FRAMING_H

#include <stdint.h>
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

#endif
